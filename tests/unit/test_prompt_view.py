"""The bounded request view, the prompt thread's queue bound, the parser process's
queue bound and tokenising in pieces: the parts every router surface shares."""

import asyncio
import threading

import pytest

from eldr_sglang.prompts import load_tokenizer
from eldr_sglang.router.http import prompt_view as pv
from eldr_sglang.router.http.bodies import BadRequest, BodyError, BodyParser, prepare
from eldr_sglang.router.signals.prompt_work import PromptWork


def test_the_view_is_bounded_whatever_the_body():
    huge = "word " * 200_000
    v = pv.bounded_view({"text": huge}, "generate", 256)
    assert v == {"text": huge[:pv.VIEW_CHARS]}
    v = pv.bounded_view({"text": [huge] * 100}, "generate", 256)
    assert sum(map(len, v["text"])) <= pv.VIEW_TOTAL_CHARS
    v = pv.bounded_view({"input_ids": list(range(100_000))}, "generate", 256)
    assert len(v["input_ids"]) == pv.VIEW_TOKENS
    v = pv.bounded_view({"prompt": [[1] * 10_000] * 200}, "v1/completions", 256)
    assert sum(map(len, v["prompt"])) <= pv.VIEW_TOTAL_TOKENS
    msgs = [{"role": "user", "content": huge}] * 10_000
    v = pv.bounded_view({"messages": msgs}, "v1/chat/completions", 256)
    assert len(v["messages"]) <= pv.VIEW_MESSAGES
    assert sum(len(m["content"]) for m in v["messages"]) <= pv.VIEW_TOTAL_CHARS
    v = pv.bounded_view({"input_ids": [1], "junk": [[]] * 1000, "n": 3}, "generate", 256)
    assert v == {"input_ids": [1]}  # /generate reads no top-level n: it is not in the view


@pytest.mark.parametrize("body,endpoint,field,status", [
    ({"text": ["a"] * 9}, "generate", "text", 413),
    ({"input_ids": [[1]] * 9}, "generate", "input_ids", 413),
    ({"prompt": ["a"] * 9}, "v1/completions", "prompt", 413),
    ({"input_ids": [2 ** 63]}, "generate", "input_ids", 400),
    ({"input_ids": [1, True]}, "generate", "input_ids", 400),
    ({"prompt": [[1], [-1]]}, "v1/completions", "prompt", 400),
    ({"input_ids": [1], "stream": [1]}, "generate", "stream", 400),
    ({"input_ids": [1], "model": {"a": 1}}, "generate", "model", 400),
    ({"prompt": "a", "n": "2"}, "v1/completions", "'n'", 400),
    ({"prompt": "a", "best_of": 2.0}, "v1/completions", "best_of", 400),
    ({"text": "a", "sampling_params": {"n": "+2"}}, "generate", "sampling_params.n", 400),
    ({"messages": [{"role": "user", "content": "a"}], "n": [[]] * 5}, "v1/chat/completions", "'n'", 400),
])
def test_the_view_refuses_by_field(body, endpoint, field, status):
    with pytest.raises(BadRequest) as e:
        pv.bounded_view(body, endpoint, 8)
    assert e.value.status == status and field in str(e.value)
    raw = __import__("orjson").dumps(body)
    out = pv.prompt_view(raw, endpoint, 8)
    assert out[0] == "error" and out[1] == status and field in out[2]


def test_pd_prepare_reads_the_same_scalars_and_prompt_lists_as_batches():
    out = prepare(b'{"prompt": "a", "stream": "yes"}', "v1/completions", 8)
    assert out[0] == "error" and "'stream'" in out[2]
    out = prepare(b'{"prompt": ["a", "b", "c"]}', "v1/completions", 8)
    assert out[0] == "ok" and out[2] == 3  # one bootstrap room per prompt
    out = prepare(b'{"prompt": [1, 2, 3]}', "v1/completions", 8)
    assert out[0] == "ok" and out[2] is None  # token ids of one prompt


def test_score_endpoint_named_or_implied():
    assert pv.score_endpoint({"messages": []}) == "v1/chat/completions"
    assert pv.score_endpoint({"prompt": "a"}) == "v1/completions"
    assert pv.score_endpoint({"endpoint": "/generate"}) == "generate"
    with pytest.raises(BadRequest, match="'endpoint'"):
        pv.score_endpoint({"endpoint": ["generate"]})


async def test_prompt_work_refuses_beyond_its_queue():
    work = PromptWork(max_queued=2)
    gate = threading.Event()
    running = [asyncio.ensure_future(work.run(gate.wait, 30)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(BodyError) as e:
        await work.run(lambda: 1)
    assert e.value.status == 503 and work.refused == 1
    running[1].cancel()  # a caller that gave up: its job still counts until it ends
    await asyncio.sleep(0)
    assert work.pending == 2
    gate.set()
    assert await running[0] is True
    for _ in range(100):
        if work.pending == 0:
            break
        await asyncio.sleep(0.01)
    assert work.pending == 0 and await work.run(lambda: 7) == 7
    work.close()


async def test_parser_process_queue_is_bounded():
    parser = BodyParser(off_loop_bytes=20, max_pending=0)
    with pytest.raises(BodyError) as e:
        await parser.run(prepare, b'{"text": "a long enough body"}', "generate", 8)
    assert e.value.status == 503 and parser.refused == 1
    assert (await parser.run(prepare, b'{"text": "a"}', "generate", 8))[0] == "ok"  # small: on the loop
    parser.close()


def test_pieces_give_the_whole_texts_ids():
    tok = load_tokenizer("models/eldr-tiny-moe")
    text = "Routing by expert locality keeps a decode batch's experts few. " * 300
    assert tok.encode_pieces(text) == tok.encode(text)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    assert tok.chat_pieces(msgs) == tok.chat(msgs)
