"""ConversationList over a real store: listing, selection, search, new / rename / delete, menu."""

import time
from datetime import datetime

import pytest
from PySide6.QtCore import Qt

from app.gui.chat.conversation_list import SEARCH_DEBOUNCE_MS, ConversationList, relative_time
from app.storage import ConversationStore
from tests.screenshots import save_screenshot

pytestmark = pytest.mark.gui


@pytest.fixture
def store(tmp_path):
    with ConversationStore(tmp_path / "chats.sqlite3") as opened:
        yield opened


@pytest.fixture
def chats(store):
    """Three chats; the newest (most recently active) first in the list."""
    soup = store.create("Soup recipes")
    store.add_message(soup.id, "user", "How long do I simmer a minestrone?")
    trip = store.create("Trip to Zürich")
    store.add_message(trip.id, "user", "Trains from Basel?")
    rust = store.create("Rust lifetimes")
    return {"soup": soup.id, "trip": trip.id, "rust": rust.id}


@pytest.fixture
def sidebar(qtbot, store, chats):
    widget = ConversationList(store)
    qtbot.addWidget(widget)
    widget.resize(280, 420)
    widget.show()
    return widget


def _click_row(qtbot, sidebar, row):
    rect = sidebar.chats.visualRect(sidebar.chats.model().index(row, 0))
    qtbot.mouseClick(sidebar.chats.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())


def test_lists_newest_first_and_a_click_selects(qtbot, sidebar, chats):
    assert sidebar.ids() == [chats["rust"], chats["trip"], chats["soup"]]
    assert sidebar.current_id() is None and not sidebar.delete_button.isEnabled()
    with qtbot.waitSignal(sidebar.sig_selected, timeout=1000) as selected:
        _click_row(qtbot, sidebar, 1)
    assert selected.args == [chats["trip"]] and sidebar.current_id() == chats["trip"]
    assert sidebar.rename_button.isEnabled() and sidebar.delete_button.isEnabled()


def test_select_and_refresh_do_not_emit(qtbot, sidebar, store, chats):
    emitted = []
    sidebar.sig_selected.connect(emitted.append)
    sidebar.select(chats["soup"])
    store.add_message(chats["soup"], "assistant", "About 30 minutes.")  # now the newest
    sidebar.refresh()
    assert emitted == [] and sidebar.current_id() == chats["soup"]
    assert sidebar.ids()[0] == chats["soup"] and sidebar.chats.currentRow() == 0


def test_search_filters_as_you_type_debounced(qtbot, sidebar, chats):
    qtbot.keyClicks(sidebar.search, "basel")  # QTest types ASCII only
    assert len(sidebar.ids()) == 3, "debounced: not filtered on every key"
    qtbot.waitUntil(lambda: sidebar.ids() == [chats["trip"]], timeout=SEARCH_DEBOUNCE_MS * 10)
    sidebar.search.setText("MINESTRONE")  # a match in a message, any case
    qtbot.waitUntil(lambda: sidebar.ids() == [chats["soup"]], timeout=SEARCH_DEBOUNCE_MS * 10)
    sidebar.search.setText("zÜR")  # the title, any case, beyond ASCII
    qtbot.waitUntil(lambda: sidebar.ids() == [chats["trip"]], timeout=SEARCH_DEBOUNCE_MS * 10)
    sidebar.search.clear()
    qtbot.waitUntil(lambda: len(sidebar.ids()) == 3, timeout=SEARCH_DEBOUNCE_MS * 10)


def test_a_filtered_out_chat_stays_current(qtbot, sidebar, chats):
    sidebar.select(chats["rust"])
    sidebar.search.setText("soup")
    qtbot.waitUntil(lambda: sidebar.ids() == [chats["soup"]], timeout=SEARCH_DEBOUNCE_MS * 10)
    assert sidebar.current_id() == chats["rust"] and sidebar.chats.currentRow() == -1


def test_new_asks_the_owner(qtbot, sidebar):
    with qtbot.waitSignal(sidebar.sig_new_requested, timeout=1000):
        qtbot.mouseClick(sidebar.new_button, Qt.MouseButton.LeftButton)


def test_rename_stores_the_new_title(qtbot, sidebar, store, chats):
    asked = []
    sidebar.ask_title = lambda parent, current: asked.append(current) or "  Borrow checker  "
    sidebar.select(chats["rust"])
    with qtbot.waitSignal(sidebar.sig_renamed, timeout=1000) as renamed:
        qtbot.mouseClick(sidebar.rename_button, Qt.MouseButton.LeftButton)
    assert asked == ["Rust lifetimes"] and renamed.args == [chats["rust"], "Borrow checker"]
    assert store.get(chats["rust"]).title == "Borrow checker"
    assert sidebar.chats.item(0).data(Qt.ItemDataRole.UserRole + 1).title == "Borrow checker"
    sidebar.ask_title = lambda parent, current: None  # cancelled
    sidebar.rename(chats["rust"])
    assert store.get(chats["rust"]).title == "Borrow checker"


def test_delete_asks_first_then_moves_to_a_neighbour(qtbot, sidebar, store, chats):
    sidebar.select(chats["trip"])
    sidebar.confirm = lambda parent, title: False
    qtbot.mouseClick(sidebar.delete_button, Qt.MouseButton.LeftButton)
    assert store.get(chats["trip"]).title == "Trip to Zürich", "refused: nothing deleted"

    questions, deleted, selected = [], [], []
    sidebar.confirm = lambda parent, title: questions.append(title) or True
    sidebar.sig_deleted.connect(deleted.append)
    sidebar.sig_selected.connect(selected.append)
    qtbot.mouseClick(sidebar.delete_button, Qt.MouseButton.LeftButton)
    assert questions == ["Trip to Zürich"] and deleted == [chats["trip"]]
    with pytest.raises(KeyError):
        store.get(chats["trip"])
    assert sidebar.ids() == [chats["rust"], chats["soup"]]
    assert selected == [chats["soup"]] and sidebar.current_id() == chats["soup"]


def test_deleting_the_last_chat_leaves_none_current(qtbot, store, tmp_path):
    only = store.create("Only")
    sidebar = ConversationList(store)
    qtbot.addWidget(sidebar)
    sidebar.confirm = lambda parent, title: True
    sidebar.select(only.id)
    sidebar.delete(only.id)
    assert sidebar.ids() == [] and sidebar.current_id() is None
    assert not sidebar.delete_button.isEnabled()


def test_store_errors_are_reported_not_raised(qtbot, sidebar, store, chats):
    errors = []
    sidebar.report_error = lambda parent, message: errors.append(message)
    sidebar.confirm = lambda parent, title: True
    store.close()
    sidebar.delete(chats["rust"])
    sidebar.refresh()
    assert len(errors) == 2 and all(str(store.path) in e for e in errors)


def test_the_context_menu_offers_the_same_actions(qtbot, sidebar, store, chats):
    menu = sidebar.context_menu(chats["soup"])
    actions = {a.text(): a for a in menu.actions()}
    assert list(actions) == ["New chat", "Rename…", "Delete…"]
    sidebar.ask_title = lambda parent, current: "Minestrone"
    actions["Rename…"].trigger()
    assert store.get(chats["soup"]).title == "Minestrone"
    with qtbot.waitSignal(sidebar.sig_new_requested, timeout=1000):
        actions["New chat"].trigger()
    empty = {a.text(): a.isEnabled() for a in sidebar.context_menu(None).actions()}
    assert empty == {"New chat": True, "Rename…": False, "Delete…": False}


def test_relative_time():
    now = datetime(2025, 6, 18, 15, 0).timestamp()  # a Wednesday
    assert relative_time(now - 10, now) == "just now"
    assert relative_time(now - 5 * 60, now) == "5 min ago"
    assert relative_time(now - 3 * 3600, now) == "3 h ago"
    assert relative_time(datetime(2025, 6, 17, 23, 0).timestamp(), now) == "yesterday"
    assert relative_time(datetime(2025, 6, 14, 9, 0).timestamp(), now) == "Saturday"
    assert relative_time(datetime(2025, 3, 2, 9, 0).timestamp(), now) == "2 Mar"
    assert relative_time(datetime(2024, 12, 31, 9, 0).timestamp(), now) == "31 Dec 2024"
    assert relative_time(now + 30, now) == "just now", "a clock that went back is not the future"


def test_screenshot(qtbot, sidebar, store, chats, tmp_path):
    store.rename(chats["soup"], "A very long title that cannot possibly fit in a narrow sidebar column")
    sidebar.refresh()
    sidebar.select(chats["trip"])
    time.sleep(0.01)
    save_screenshot(sidebar, "conversation_list.png", tmp_path)
