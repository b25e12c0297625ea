"""The guidance a chat with tools sends: in front of the chat's own system prompt, only with tools."""

from app.tools.guidance import CODE_GUIDANCE, GUIDANCE, tools_guidance, with_guidance

FILES = [{"type": "function", "function": {"name": "files__read_file"}}]
OTHER = [{"type": "function", "function": {"name": "git__status"}}]
USER = [{"role": "user", "content": "Where is slugify?"}]


def test_no_tools_no_guidance():
    assert tools_guidance([]) == "" and with_guidance(USER, []) == USER


def test_the_guidance_is_the_system_message_of_a_chat_without_one():
    messages = with_guidance(USER, FILES)
    assert messages[0] == {"role": "system", "content": CODE_GUIDANCE} and messages[1:] == USER


def test_the_chats_own_system_prompt_follows_the_guidance():
    messages = with_guidance([{"role": "system", "content": "Be terse."}, *USER], OTHER)
    assert messages[0]["content"] == f"{GUIDANCE}\n\nBe terse." and len(messages) == 2
    assert "apply_edit" not in messages[0]["content"]  # the code tools' guidance only with the built-in tools


def test_the_messages_given_are_not_changed():
    own = [{"role": "system", "content": "Be terse."}, *USER]
    with_guidance(own, FILES)
    assert own[0]["content"] == "Be terse."
