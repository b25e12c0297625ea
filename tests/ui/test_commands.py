"""The command table: every command has its handler, keys bind by id, and the config's keymap may
rebind exactly the commands that have keys."""

from __future__ import annotations

from app.ui import chat_commands
from app.ui.commands import ACTION_IDS, COMMANDS, command_bindings, effective_keys, palette_help


def test_every_command_has_a_handler_and_bound_ones_a_binding() -> None:
    assert len({c.id for c in COMMANDS}) == len(COMMANDS)
    for command in COMMANDS:
        assert callable(getattr(chat_commands, command.id)), command.id
    bindings = {b.id: b for b in command_bindings()}
    assert set(bindings) == set(ACTION_IDS) == {c.id for c in COMMANDS if c.keys}
    assert bindings["new_tab"].action == "command('new_tab')" and bindings["new_tab"].key == "ctrl+n"
    assert "send" not in bindings  # the palette only


def test_keys_in_force_and_the_palette_help() -> None:
    keys = effective_keys({"new_tab": "ctrl+t"})
    assert keys["new_tab"] == "ctrl+t" and keys["next_tab"] == "ctrl+pagedown,alt+right"
    by_id = {c.id: c for c in COMMANDS}
    assert palette_help(by_id["next_tab"], keys) == "Switch to the next chat tab (ctrl+pagedown / alt+right)"
    assert palette_help(by_id["send"], keys) == "Send the input to the current tab (enter)"
