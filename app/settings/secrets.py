"""Secrets in the OS keyring, never in settings.json and never in a log.

`system_keyring()` is the usable keyring backend or None (no backend, or only the fail/empty
chainer, as on a headless Linux box). `ApiKeys` keeps one key per remote endpoint under the
service "moe-chat-remote" (user: the endpoint's API root); where there is no keyring, or it
refuses, a key is kept in memory for this run only and `set` says so in a sentence for the
user. The Hugging Face token (`app.gui.models.hub_client`) uses the same `system_keyring`.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

REMOTE_KEYRING_SERVICE = "moe-chat-remote"
IN_KEYRING = "the system keyring"
SESSION_ONLY = (
    "No system keyring is available on this computer, so the key is kept only until MoE Chat "
    "closes; enter it again next time (or install a keyring backend, e.g. gnome-keyring or KWallet)."
)


def system_keyring():
    """The system keyring, or None where there is no usable backend."""
    try:
        import keyring
        from keyring.backends import chainer, fail
    except ImportError:
        return None
    backend = keyring.get_keyring()
    if isinstance(backend, fail.Keyring):
        return None
    if isinstance(backend, chainer.ChainerBackend) and not backend.backends:
        return None
    return backend


def keyring_store(backend, service: str, user: str, secret: str) -> str | None:
    """Put `secret` in `backend` (`system_keyring()`'s); None where there is none or it refuses (the
    reason is logged, never the secret), so the caller falls back to its own place."""
    if backend is None:
        log.warning("No system keyring for %s's secret", service)
        return None
    from keyring.errors import KeyringError

    try:
        backend.set_password(service, user, secret)
    except KeyringError as err:
        log.warning("The keyring refused %s's secret (%s)", service, err)
        return None
    return IN_KEYRING


class ApiKeys:
    """API keys by endpoint (its base URL): the keyring's, else this run's memory."""

    def __init__(self, service: str = REMOTE_KEYRING_SERVICE):
        self.service = service
        self._session: dict[str, str] = {}  # keys the keyring could not take: this run only

    def set(self, endpoint: str, key: str) -> str:
        """Keep `key` for `endpoint`; returns where it went, a sentence for the user."""
        key = key.strip()
        if not key:
            raise ValueError("The API key is empty (to remove a key, delete it instead).")
        if keyring_store(system_keyring(), self.service, endpoint, key) is not None:
            self._session.pop(endpoint, None)
            return IN_KEYRING
        log.warning("The API key for %s is kept for this run only", endpoint)
        self._session[endpoint] = key
        return SESSION_ONLY

    def get(self, endpoint: str) -> str | None:
        if endpoint in self._session:
            return self._session[endpoint]
        backend = system_keyring()
        if backend is None:
            return None
        from keyring.errors import KeyringError

        try:
            return backend.get_password(self.service, endpoint) or None
        except KeyringError as err:
            log.warning("Cannot read the keyring (%s)", err)
            return None

    def delete(self, endpoint: str) -> None:
        """Forget the key of `endpoint` (nothing happens when there is none)."""
        self._session.pop(endpoint, None)
        backend = system_keyring()
        if backend is None:
            return
        from keyring.errors import KeyringError, PasswordDeleteError

        try:
            backend.delete_password(self.service, endpoint)
        except PasswordDeleteError:
            pass  # there was none
        except KeyringError as err:
            log.warning("Cannot delete the API key of %s from the keyring (%s)", endpoint, err)
