"""Chat templates in the tool-calling conventions of Llama 3.x and Mistral, written for the tests (the shapes that
tokenizer/tool_formats.detect_format_name reads: Llama's "parameters" key and ipython environment, Mistral's
[TOOL_CALLS] list and its 9-character call ids, Mistral v11's [TOOL_CALLS]name[ARGS]{...}), and a tokenizer that has
their marker tokens."""

from __future__ import annotations

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if tools %}system: Environment: ipython\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' and tools and loop.last %}user: Given the following functions, respond with a JSON for "
    "a function call, in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ m.content }}\n"
    "{% elif m.tool_calls %}assistant: {% for c in m.tool_calls %}"
    "{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' }}{{ c.function.arguments | tojson }}}"
    "{% endfor %}\n"
    "{% elif m.role == 'tool' %}ipython: {{ m.content }}\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")

# Llama 3.1's own rule: one call per assistant turn, else the template raises
LLAMA31_SINGLE_CALL_TEMPLATE = LLAMA3_TEMPLATE.replace(
    "{% elif m.tool_calls %}", "{% elif m.tool_calls %}{% if m.tool_calls | length != 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}")

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{% if c.id is not defined or c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}"
    "[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}")

# mistral-common's v11 convention (Mistral Small 3.1+, Devstral): each call is [TOOL_CALLS], the name, [CALL_ID] and
# the id, [ARGS] and the arguments (v13+ leave the id out)
MISTRAL_V11_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]"
    "{% elif m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}{{ m.content or '' }}{% for c in m.tool_calls %}"
    "{% if c.id is not defined or c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]{{ c.function.arguments | tojson }}"
    "{% endfor %}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.tool_call_id }}[TOOL_CONTENT]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
V11_MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]

MARKERS = ["<|python_tag|>", "[TOOL_CALLS]"]


def add_marker_tokens(directory, markers: list[str] = MARKERS) -> dict[str, int]:
    """Adds marker tokens (special; by default <|python_tag|> and [TOOL_CALLS]) to a model directory's
    tokenizer.json; their ids."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    path = str(directory / "tokenizer.json")
    tok = HFTokenizer.from_file(path)
    tok.add_special_tokens([AddedToken(m, special=True) for m in markers])
    tok.save(path)
    return {m: tok.token_to_id(m) for m in markers}


def set_chat_template(directory, template: str) -> None:
    import json

    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))


# a reasoning model's template in the DeepSeek-R1-distill style (written for the tests): earlier answers lose their
# thinking, and the generation prompt opens the block
REASONING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}"
    "assistant: {{ (m.content or '').split('</think>')[-1] }}\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: <think>\n{% endif %}")


def add_reasoning_tokens(directory) -> dict[str, int]:
    """Adds <think> and </think> as ordinary (non-special) added tokens, as the R1 distills have them."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    path = str(directory / "tokenizer.json")
    tok = HFTokenizer.from_file(path)
    tok.add_tokens([AddedToken(t, special=False) for t in ("<think>", "</think>")])
    tok.save(path)
    return {t: tok.token_to_id(t) for t in ("<think>", "</think>")}


# a Magistral-style reasoning template (written for the tests): [THINK] ... [/THINK] special tokens, the system prompt
# asks for them, earlier answers lose their thinking, and the generation prompt does not open the block
MAGISTRAL_TEMPLATE = (
    "{{ bos_token }}[SYSTEM_PROMPT]First draft your thinking inside [THINK]...[/THINK].[/SYSTEM_PROMPT]"
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ (m.content or '').split('[/THINK]')[-1] }}"
    "{{ eos_token }}{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}")
