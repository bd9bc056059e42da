"""`moe-chat` / `python -m app`: the desktop app's entry point.

Opens the main window at once (no torch in this process) and starts the engine
worker in the background; a second start brings the running window to the
front instead of opening another (one with another data folder, MOE_CHAT_DATA_DIR, runs on its
own). `--self-test` checks the installation instead
(see `app.gui.startup.self_test`); `moe-chat cli [...]` is `moe-chat-cli [...]` (the terminal
chat, and `cli serve` the local server), for the bundle, which has one executable.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-chat",
        description="Chat with Mixture-of-Experts models",
        epilog="moe-chat cli [...] runs the terminal chat, and moe-chat cli serve the local server "
        "(see moe-chat cli --help).",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    test = parser.add_argument_group("self-test")
    test.add_argument(
        "--self-test",
        action="store_true",
        help="start the engine, load the demo model, generate a few tokens, print one line; exit 0 or 1",
    )
    test.add_argument("--window", action="store_true", help="with --self-test: chat through the main window")
    test.add_argument("--screenshot", type=Path, help="with --self-test --window: save the window as a PNG")
    test.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="with --self-test")
    desktop = parser.add_argument_group("Linux desktop integration").add_mutually_exclusive_group()
    desktop.add_argument(
        "--install-desktop-entry", action="store_true", help="add MoE Chat to the application menu"
    )
    desktop.add_argument("--uninstall-desktop-entry", action="store_true", help="remove it again")
    return parser


def main(argv: list[str] | None = None) -> int:
    multiprocessing.freeze_support()  # the frozen app runs the worker through this executable
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["cli"]:  # the bundle's one executable also carries the terminal chat and the server
        from app.terminal.chat import main as cli_main

        return cli_main(argv[1:])
    parser = build_parser()
    args, qt_args = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.install_desktop_entry or args.uninstall_desktop_entry:
        return desktop_entry(args.install_desktop_entry)
    if args.self_test:
        from app.gui.startup import self_test

        if args.window:
            return self_test.window_self_test(args.device, args.screenshot)
        return self_test.engine_self_test(args.device)
    if args.window or args.screenshot:
        parser.error("--window and --screenshot go with --self-test")
    from app.gui.startup.log_setup import setup_logging

    setup_logging(args.verbose)  # one line per warning on the console, the details in the log file

    from app.gui.startup.system_libs import qt_platform_problem

    problem = qt_platform_problem(qt_args)  # one line naming the packages, not Qt's abort
    if problem:
        sys.stderr.write(problem + "\n")
        return 1
    from app.gui.startup.application import FirstGpuTuneOffer, application
    from app.gui.startup.single_instance import SingleInstance, server_name
    from app.gui.window.main_window import MainWindow
    from app.model_library import data_dir

    app = application(qt_args)
    folder = data_dir()
    instance = SingleInstance(server_name(data_folder=folder))  # another data folder runs on its own
    if instance.ask_running_instance():
        sys.stdout.write(f"MoE Chat already runs with the data folder {folder}: its window is in front.\n")
        return 0
    instance.listen()
    window = MainWindow()
    FirstGpuTuneOffer(window)  # the first start on a GPU offers the auto-tune wizard
    instance.sig_activate.connect(window.bring_to_front)
    window.show()
    window.start_engine()
    try:
        return app.exec()
    finally:
        instance.close()


def desktop_entry(install: bool) -> int:
    from app import desktop_entry

    if not sys.platform.startswith("linux"):
        sys.stderr.write("Desktop entries are for Linux; on Windows and macOS the installer adds the icon.\n")
        return 2
    try:
        if install:
            path = desktop_entry.install()
            sys.stdout.write(f"Added MoE Chat to the application menu: {path}\n")
        else:
            removed = desktop_entry.uninstall()
            sys.stdout.write(f"Removed {len(removed)} files of MoE Chat's desktop entry.\n")
    except OSError as err:
        sys.stderr.write(f"error: could not write the desktop entry: {err}\n")
        return 1
    return 0
