"""The shipped model's chat template (``models/eldr-tiny-moe/chat_template.jinja``):
loaded by its tokenizer, rendered as documented, read by SGLang as a string template,
and used by the routers that tokenize chats themselves (co-located, early binding)."""

from eldr_sglang.prompts import load_tokenizer, request_token_ids
from tests.helpers import ROOT

MODEL = ROOT / "models" / "eldr-tiny-moe"
MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Solve 3x + 7 = 22."}]


def test_the_tokenizer_loads_the_template_and_renders_a_plain_document():
    tok = load_tokenizer(MODEL)
    assert tok.hf.chat_template
    text = tok.hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == "<s>System: You answer briefly.\nUser: Solve 3x + 7 = 22.\nAssistant:"
    assert tok.hf.apply_chat_template(MESSAGES, tokenize=False).endswith("22.\n")  # no reply asked


def test_chat_ids_are_the_rendered_text_with_bos_and_content_parts_read_as_text():
    tok = load_tokenizer(MODEL)
    ids = tok.chat(MESSAGES)
    assert ids[0] == tok.hf.bos_token_id and all(isinstance(t, int) for t in ids)
    assert ids[1:] == tok.encode("System: You answer briefly.\nUser: Solve 3x + 7 = 22.\nAssistant:")
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Solve 3x + 7 = 22."}]}]
    assert tok.chat(parts) == ids
    assert request_token_ids({"messages": MESSAGES}, "v1/chat/completions", tok) == [ids]


def test_sglang_reads_it_as_a_string_template():
    from sglang.srt.parser.jinja_template_utils import detect_jinja_template_content_format

    assert detect_jinja_template_content_format((MODEL / "chat_template.jinja").read_text()) == "string"
