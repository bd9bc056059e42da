"""What runs around the main window: the app's start, its process-wide set-up and `--self-test`.

- `application`: the QApplication (its name and icon), and `FirstGpuTuneOffer`, the auto-tune
  wizard offered once on the first start on a GPU;
- `log_setup`: where log records go (one line on the console, everything in the log file);
- `single_instance`: one running MoE Chat per user and data folder;
- `system_libs`: whether the system libraries Qt's X11 plugin loads are there; no Qt;
- `self_test`: `moe-chat --self-test`, the engine (or with `--window` the whole app) checked.

May import: every room of `app.gui` (the self-test opens the main window).
"""
