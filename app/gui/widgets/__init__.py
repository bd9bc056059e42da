"""Widgets any window or dialog of the app uses; they know nothing of the engine, the chat or models.

- `banner`: `BannerArea`, non-blocking banners (errors, warnings, notes) stacked at a window's top;
- `error_panel`: `ErrorPanel`, a failure's sentence with its technical details behind "Details…";
- `window_state`: `fit_to_screen` for any top-level window, and `WindowMemory`, the main window's
  geometry remembered between starts.

May import: PySide6 and the Qt-free modules of `app`. No other room of `app.gui`.
"""
