"""The app's user settings, in three parts: what each field is (`fields`), the validated model
(`app_settings`) and where it is kept (`store`).

`fields.FIELDS` describes each setting (title, summary, help, choices or bounds) and the
dialog is built from it; `app_settings.AppSettings` is one frozen dataclass whose `validate()`
names the offending field in a `SettingsError`; `store.SettingsStore` keeps it as JSON and
never fails to load. The three names most callers need are importable from here.
`remotes.RemoteStore` keeps the saved remote engines (remotes.json), `secrets` their API keys
(and the Hugging Face token) in the OS keyring; `server_prefs` the local server's port, whether it
starts with the app (server.json) and its API key (the keyring).

No Qt and no torch here: the settings dialog is `app.gui.settings.settings_dialog`.
"""

from app.settings.app_settings import AppSettings, SettingsError
from app.settings.store import SettingsStore

__all__ = ["AppSettings", "SettingsError", "SettingsStore"]
