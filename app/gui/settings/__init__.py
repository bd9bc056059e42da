"""The app's settings screen; the settings themselves (fields, validation, storage) are `app.settings`.

- `settings_dialog`: `SettingsDialog`, built from `app.settings.fields.FIELDS`, which validates
  before it hands valid settings to its owner.

May import: PySide6, the Qt-free modules of `app`, the engine's torch-free modules, and the
`widgets` and `engine` rooms. Never another screen, `window` or `startup`.
"""
