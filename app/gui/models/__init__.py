"""The model picker: the catalog with fit estimates, Hub search, downloads, local folders and remotes.

- `model_picker`: `ModelPicker`, the dialog: its Catalog tab, and the other tabs put together;
- `picker_widgets`: its pieces: catalog cells, a download's row, the local-models page;
- `model_import`: `ModelImporter`, a folder or GGUF file imported by dialog or drop (asking which
  file where a folder holds several), and the open-file dialog;
- `background`: `BackgroundCall`, a blocking call on a worker thread;
- `hub_search_page`: the "Search the Hub" tab;
- `remote_page`: the "Remote" tab, saved OpenAI-compatible engines, their keys and models;
- `downloads`: `DownloadManager`, downloads in child processes the user can cancel;
- `hub_client`: the Hub calls made in the GUI process (search, the token); no Qt.

May import: PySide6, the Qt-free modules of `app`, the engine's torch-free modules, and the
`widgets` and `engine` rooms. Never another screen, `window` or `startup`.
"""
