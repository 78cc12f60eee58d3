"""`dflash-trt bench --endpoint`: the sweep against a real streaming OpenAI-compatible HTTP server on
127.0.0.1 (a small stdlib server over our engine and continuous-batching Scheduler)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from dflash_trt.cli import main
from dflash_trt.prompts import chat_prompt_ids
from dflash_trt.models.tiny import save_tiny_checkpoint
from dflash_trt.runtime.factory import LoadConfig, load_torch
from dflash_trt.runtime.scheduler import FinalEvent, Scheduler, TokenEvent
from dflash_trt.engine import EngineConfig, SamplingParams

KEY = "sk-test"
MODEL = "tiny-dflash"


def _handler(models, scheduler, seen):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def _authorized(self) -> bool:
            if self.headers.get("Authorization") == f"Bearer {KEY}":
                return True
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b'{"error": "bad key"}')
            return False

        def do_GET(self):
            if self._authorized():
                self.send_response(200)
                self.end_headers()
                self.wfile.write(json.dumps({"data": [{"id": MODEL}]}).encode())

        def do_POST(self):
            if not self._authorized():
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chat = self.path.endswith("/chat/completions")
            ids = (chat_prompt_ids(models.tokenizer, body["messages"][0]["content"]) if chat
                   else models.tokenizer.encode(body["prompt"]))
            handle = scheduler.submit(ids, SamplingParams(max_new_tokens=body["max_tokens"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            while True:
                ev = handle.get(timeout=60)
                if isinstance(ev, TokenEvent) and ev.tokens:
                    text = "x" + models.detokenize(ev.tokens)  # never empty: one chunk per engine step
                    choice = {"delta": {"content": text}} if chat else {"text": text}
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                elif isinstance(ev, FinalEvent):
                    r = ev.result
                    usage = {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens)}
                    stats = {"mean_acceptance_length": r.mean_acceptance_length, "steps": len(r.steps)}
                    seen.append(r)  # our server's shape: a usage chunk with the `dflash` extension
                    final = {"choices": [], "usage": usage, "dflash": stats}
                    self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
                    return

    return Handler


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_endpoint")
    target, drafter = save_tiny_checkpoint(root, "llama", seed=1, block_size=4)
    models = load_torch(LoadConfig(Path(target), Path(drafter), dtype="float64"))
    scheduler = Scheduler(models.engine(EngineConfig(max_batch_size=4, max_seq_len=900))).start()
    seen = []  # GenerationResults the server returned
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(models, scheduler, seen))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    prompts = root / "p.jsonl"
    prompts.write_text('{"prompt": "Name three colors."}\n{"prompt": "def f(x):\\n", "kind": "code"}\n')
    yield f"http://127.0.0.1:{httpd.server_address[1]}", prompts, seen
    httpd.shutdown()
    scheduler.shutdown()


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_endpoint_sweep(server, tmp_path):
    url, prompts, seen = server
    seen.clear()
    rc = main(["bench", "--endpoint", url, "--api-key", KEY, "--dataset", str(prompts), "--concurrency", "1,3",
               "--max-new-tokens", "8", "--threads", "1", "--no-progress", "--output", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["errors"] == [] and report["records"] == []
    assert report["config"]["model"] == MODEL and report["config"]["endpoint"] == url + "/v1"
    sweep = report["sweep"]
    assert [(p["mode"], p["concurrency"], p["requests"]) for p in sweep] == [
        (f"endpoint:{MODEL}", 1, 2), (f"endpoint:{MODEL}", 3, 3)]
    served = [seen[:2], seen[2:]]  # the results the server produced for each point, in order
    for p, results in zip(sweep, served):
        assert p["token_count_source"] == "usage"
        assert p["tokens"] == sum(len(r.tokens) for r in results) and 0 < p["tokens"] <= 8 * p["requests"]
        steps = sum(len(r.steps) for r in results)
        assert p["tau"] == pytest.approx(sum(s.accepted + 1 for r in results for s in r.steps) / steps)
        assert 1.0 <= p["tau"] <= 4 and p["ttft_s"]["mean"] > 0 and p["tokens_per_s_per_user"] > 0
    assert "## Concurrency sweep" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "pareto.png").stat().st_size > 1000


def test_endpoint_request_failures_are_errors(server, tmp_path, capsys):
    url, prompts, _ = server
    rc = main(["bench", "--endpoint", url, "--api-key", "wrong", "--model", MODEL, "--dataset", str(prompts),
               "--concurrency", "1", "--max-new-tokens", "4", "--no-progress", "--no-plots", "--output", str(tmp_path)])
    assert rc == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["errors"]) == 2 and all("HTTP 401" in e["message"] for e in report["errors"])
    assert "HTTP 401" in capsys.readouterr().err


def test_endpoint_unreachable_is_a_user_error(tmp_path, capsys):
    rc = main(["bench", "--endpoint", "http://127.0.0.1:9", "--dataset", "humaneval", "--limit", "1",
               "--concurrency", "1", "--no-progress", "--output", str(tmp_path)])
    assert rc == 2
    assert "cannot reach" in capsys.readouterr().err
