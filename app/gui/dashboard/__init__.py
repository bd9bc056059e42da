"""The dashboard screen: the worker's (or a remote server's) telemetry as numbers and sparklines.

- `dashboard`: `Dashboard`, the live panel the main window docks beside the chat;
- `dashboard_parts`: formatting of figures, painted text lines, the cache bar and metric tiles;
- `sparkline`: `Sparkline`, a small live line plot of the last minute of one series;
- `remote_dashboard`: `RemotePanel`, what is measured and exported for a remote engine.

May import: PySide6, the Qt-free modules of `app`, the engine's torch-free modules, and the
`widgets` and `engine` rooms. Never another screen, `window` or `startup`.
"""
