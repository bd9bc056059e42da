"""`moe-chat` / `python -m app`: the desktop app's entry point.

Opens the main window at once (no torch in this process) and starts the engine
worker in the background; a second start brings the running window to the
front instead of opening another.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import sys


def main(argv: list[str] | None = None) -> int:
    multiprocessing.freeze_support()  # the frozen app runs the worker through this executable
    parser = argparse.ArgumentParser(prog="moe-chat", description="Chat with Mixture-of-Experts models")
    parser.add_argument("-v", "--verbose", action="store_true")
    args, qt_args = parser.parse_known_args(argv if argv is not None else sys.argv[1:])
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")

    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow
    from app.single_instance import SingleInstance

    app = QApplication.instance() or QApplication([sys.argv[0], *qt_args])
    app.setApplicationName("MoE Chat")
    app.setOrganizationName("MoE Chat")
    instance = SingleInstance()
    if instance.ask_running_instance():
        logging.getLogger(__name__).info("MoE Chat is already running: brought it to the front.")
        return 0
    instance.listen()
    window = MainWindow()
    instance.sig_activate.connect(window.bring_to_front)
    window.show()
    window.start_engine()
    try:
        return app.exec()
    finally:
        instance.close()
