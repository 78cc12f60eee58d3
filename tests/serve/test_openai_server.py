"""The real server through the official `openai` client: completions and chat, streaming and not,
greedy output identical to `dflash-trt generate`, 32 concurrent streams, metrics that add up."""
from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI

from serve_helpers import API_KEY, BLOCK_SIZE, GREEDY_PROMPT, GREEDY_TOKENS, MAX_SEQ_LEN

GREEDY = {"temperature": 0}
EXT = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].model_extra["max_model_len"] == MAX_SEQ_LEN


def test_greedy_completion_equals_generate_cli(client, server):
    ref = server.reference
    resp = client.completions.create(model=server.model, prompt=GREEDY_PROMPT, max_tokens=GREEDY_TOKENS,
                                     extra_body=EXT, **GREEDY)
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == ref["tokens"]
    assert choice.text == ref["text"]
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == ref["prompt_tokens"]
    assert resp.usage.completion_tokens == GREEDY_TOKENS
    stats = resp.model_extra["dflash"]
    assert stats["block_size"] == BLOCK_SIZE
    assert 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["accepted_tokens"] / stats["steps"])

    # the same request streamed: identical text, usage in the final chunk
    chunks = list(client.completions.create(model=server.model, prompt=GREEDY_PROMPT, max_tokens=GREEDY_TOKENS,
                                            stream=True, extra_body=EXT, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == GREEDY_TOKENS
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ref["tokens"]


def test_chat_streaming_and_not_agree(client, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    resp = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=20,
                                          extra_body=EXT, **GREEDY)
    text = resp.choices[0].message.content
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == 20 and resp.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=20,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == resp.usage.total_tokens
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    # the chat template is applied by the server: the same prompt ids through /v1/completions agree
    ids = resp.model_extra["prompt_token_ids"]
    assert ids[0] == 3  # <|im_start|> of the tiny ChatML template
    again = client.completions.create(model=server.model, prompt=ids, max_tokens=20, extra_body=EXT, **GREEDY)
    assert again.choices[0].model_extra["token_ids"] == resp.choices[0].model_extra["token_ids"]


def test_chat_message_without_content_is_a_400_as_openai_answers(client, server):
    """OpenAI refuses a message without content with 400 missing_required_parameter; so do we."""
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=[{"role": "user"}], max_completion_tokens=4)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "messages.0.content" and info.value.body["code"] == "missing_required_parameter"
    assert "messages.0.content" in info.value.body["message"]


def test_cli_server_and_triton_encode_a_chat_prompt_to_the_same_ids(client, server, tiny_checkpoint):
    """One encoder (dflash_trt.prompts) behind `generate --chat`, /v1/chat/completions and the Triton
    model's `chat: true`; the server's ids come back with return_token_ids."""
    from dflash_trt.commands.generate import prompt_ids
    from dflash_trt.engine import SamplingParams
    from dflash_trt.runtime.factory import LoadConfig, load_backend
    from dflash_trt.serve.triton.backends import ModelBackend
    from dflash_trt.serve.triton.settings import TritonSettings

    text = "Write a haiku about tensors."
    target, drafter = tiny_checkpoint
    cli_ids = prompt_ids(load_backend("torch", LoadConfig(target, drafter)), text, None, chat=True)
    resp = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": text}],
                                          max_completion_tokens=1, extra_body=EXT, **GREEDY)
    settings = TritonSettings.from_dict({"target": str(target), "drafter": str(drafter), "chat": True,
                                         "engine": {"max_batch_size": 1, "max_seq_len": 64}}, "test")
    triton = ModelBackend(settings)
    try:
        triton_ids = triton.submit(triton.encode(text), SamplingParams(max_new_tokens=1), None).sequence.prompt
    finally:
        triton.shutdown()
    assert cli_ids == resp.model_extra["prompt_token_ids"] == triton_ids
    assert cli_ids[0] == 3 and len(cli_ids) > len(text.encode()) // 2  # the template's turn markers, then the text


def test_stop_strings_and_seeded_sampling(client, server):
    ref = server.reference["text"]
    stop = ref[6:8]
    assert stop and "\ufffd" not in stop
    resp = client.completions.create(model=server.model, prompt=GREEDY_PROMPT, max_tokens=GREEDY_TOKENS,
                                     stop=[stop], extra_body={"ignore_eos": True}, **GREEDY)
    cut = ref.index(stop)
    assert resp.choices[0].text == ref[:cut] and resp.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=server.model, prompt=GREEDY_PROMPT, max_tokens=GREEDY_TOKENS,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True}, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref[:cut]
    sampled = [client.completions.create(model=server.model, prompt=GREEDY_PROMPT, max_tokens=16, temperature=1.0,
                                         top_p=0.9, seed=7, extra_body={"top_k": 20, **EXT})
               for _ in range(2)]
    assert sampled[0].choices[0].model_extra["token_ids"] == sampled[1].choices[0].model_extra["token_ids"]


def test_32_concurrent_streaming_clients(server):
    prompts = [f"client {i}: tell me about number {i * 7}" for i in range(32)]

    async def main():
        aclient = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one_stream(prompt):
            stream = await aclient.completions.create(model=server.model, prompt=prompt, max_tokens=12, stream=True,
                                                      extra_body=EXT, **GREEDY)
            chunks = [c async for c in stream]
            ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
            return "".join(c.choices[0].text for c in chunks if c.choices), ids, chunks[-1]

        async def one_plain(prompt):
            return await aclient.completions.create(model=server.model, prompt=prompt, max_tokens=12,
                                                    extra_body=EXT, **GREEDY)

        streamed = await asyncio.gather(*(one_stream(p) for p in prompts))
        plain = await asyncio.gather(*(one_plain(p) for p in prompts))
        await aclient.close()
        return streamed, plain

    streamed, plain = asyncio.run(main())
    for (text, ids, last), ref in zip(streamed, plain):
        assert last.usage.completion_tokens == 12 and last.choices[0].finish_reason == "length"
        assert ids == ref.choices[0].model_extra["token_ids"]
        assert text == ref.choices[0].text
    m = server.metrics()
    assert m["dflash:num_requests_running"] == 0 and m["dflash:num_requests_waiting"] == 0


def test_metrics_add_up(client, server):
    before = server.metrics()
    resp = client.completions.create(model=server.model, prompt="count me", max_tokens=10, extra_body=EXT, **GREEDY)
    after = server.metrics()

    def delta(name):
        return after[name] - before.get(name, 0.0)

    stats = resp.model_extra["dflash"]
    assert delta("dflash:generation_tokens_total") == 10
    assert delta("dflash:prompt_tokens_total") == resp.usage.prompt_tokens
    assert delta("dflash:spec_decode_num_drafts_total") == stats["steps"]
    drafted_now = delta("dflash:spec_decode_num_draft_tokens_total")
    assert drafted_now == stats["draft_tokens"] == stats["steps"] * (BLOCK_SIZE - 1)
    assert delta("dflash:spec_decode_num_accepted_tokens_total") == stats["accepted_tokens"]
    assert delta('dflash:request_success_total{finished_reason="length"}') == 1
    assert delta('dflash:http_requests_total{route="/v1/completions",status="200"}') == 1
    assert delta("dflash:time_to_first_token_seconds_count") == 1
    assert delta("dflash:inter_token_latency_seconds_count") == 9
    # lifetime totals are consistent
    drafts = after["dflash:spec_decode_num_drafts_total"]
    drafted = after["dflash:spec_decode_num_draft_tokens_total"]
    accepted = after["dflash:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and accepted <= drafted == drafts * (BLOCK_SIZE - 1)
    per_pos = [after[f'dflash:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}']
               for i in range(BLOCK_SIZE - 1)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert after["dflash:spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    for i in range(BLOCK_SIZE - 1):
        rate = after[f'dflash:spec_decode_acceptance_rate_per_pos{{position="{i}"}}']
        assert rate == pytest.approx(per_pos[i] / drafts)


def test_endpoint_load_generation_against_the_server(server):
    """bench/endpoint.py, the one OpenAI load client: 8 streamed requests at concurrency 4, ignore_eos."""
    from dflash_trt.bench.endpoint import EndpointConfig, run_endpoint_sweep
    from dflash_trt.prompts import Prompt

    prompts = [Prompt(f"p{i}", "load", f"Request {i}: a story about {i}.", "code") for i in range(8)]
    cfg = EndpointConfig(url=server.url, api_key=API_KEY, ignore_eos=True)
    points, errors, model = run_endpoint_sweep(cfg, prompts, [4], 8)
    (point,) = points
    assert errors == [] and model == server.model
    assert point["requests"] == 8 and point["tokens"] == 64 and point["token_count_source"] == "usage"
    assert 0 < point["ttft_s"]["p50"] <= point["ttft_s"]["p99"] and 0 <= point["itl_s"]["p50"] <= point["itl_s"]["p99"]
    assert point["tau"] >= 1.0

def test_serve_defaults_max_seq_len_to_a_short_targets_context(tmp_path):
    """Issue 17: a target with 512 positions is served without --max-seq-len (the default is the
    target's context, not 2048), and its whole context is usable."""
    import subprocess

    import httpx
    from serve_helpers import cli, free_port, wait_healthy

    from dflash_trt.models.tiny import save_tiny_checkpoint

    target, drafter = save_tiny_checkpoint(tmp_path / "short", "llama", block_size=BLOCK_SIZE,
                                           max_position_embeddings=512)
    log, port = tmp_path / "server.log", free_port()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cli("serve", str(target), "--drafter", str(drafter), "--port", str(port),
                                    "--log-level", "warning"), stdout=fh, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log)
        [model] = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert model["id"] == str(target) and model["max_model_len"] == 512
        body = {"model": model["id"], "prompt": [3, 80, 81], "max_tokens": 509, "temperature": 0, **EXT}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert len(reply["choices"][0]["token_ids"]) == 509, reply  # 3 + 509 = the whole context
    finally:
        proc.terminate()
        proc.wait(timeout=30)
