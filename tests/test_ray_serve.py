"""``verispec serve --ray``: replicas of a tiny model behind Ray Serve on a local Ray instance bound to 127.0.0.1.

Needs the ``[ray]`` extra; without it every test here is skipped with that reason. To run them:
``.venv/bin/pip install -e '.[ray]' && .venv/bin/python -m pytest -q tests/test_ray_serve.py``.
"""

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the [ray] extra is not installed: pip install -e '.[ray]'")

import httpx2  # noqa: E402
import openai  # noqa: E402
from test_serve import alone, chat_of  # noqa: E402

from verispec.bench.serving import free_port  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")
HERE = Path(__file__).parent


@contextlib.contextmanager
def ray_server(*args):
    """tests/tiny_server.py --ray on a free port: yields (process, base URL); SIGTERM and a wait when done."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "tiny_server.py"), "--ray", "--port", str(port), *args],
                            stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            line = proc.stdout.readline()
            assert line, f"the Ray server ended before it served (status {proc.poll()})"
            if line.strip() == f"port {port}":
                break
            assert time.monotonic() < deadline, "the Ray server did not come up"
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def instances(url: str, tries: int = 60) -> dict[str, int]:
    """The replicas /health reaches (instance -> pid), asked ``tries`` times."""
    seen = {}
    for _ in range(tries):
        with contextlib.suppress(httpx2.HTTPError):
            r = httpx2.get(url + "/health", timeout=10)
            if r.status_code == 200:
                seen[r.json()["instance"]] = r.json()["pid"]
    return seen


def stream(url: str, prompt: str, max_tokens: int, started=None):
    """A streamed chat completion: (its HTTP status or None if the connection failed, the instance that served it,
    its text, whether it ended with [DONE], when it ended); ``started`` gets the instance once the answer begins."""
    status, text, done, who = None, [], False, None
    try:
        with httpx2.stream("POST", url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": chat_of(prompt), "max_tokens": max_tokens, "temperature": 0,
                "stream": True}) as r:
            status, who = r.status_code, r.headers.get("x-verispec-instance")
            if started is not None:
                started.append(who)
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        break
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
    except httpx2.HTTPError:
        pass
    return status, who, "".join(text), done, time.monotonic()


def test_two_replicas_answer_and_one_replicas_death_is_survived():
    with ray_server("--replicas", "2", "--max-batch", "2", "--max-queue", "1", "--step-delay", "0.05") as (_, url):
        pids = instances(url)
        assert len(pids) == 2, pids  # both replicas answer
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompts = ["alpha", "beta beta", "gamma", "delta delta delta"]
        for p in prompts:
            out = c.chat.completions.create(model="tiny", messages=chat_of(p), max_tokens=12, temperature=0)
            assert out.choices[0].message.content == alone(chat_of(p), 12).text

        # six long streams, three per replica (each takes at most 3 at once), then one replica is killed
        long = [f"stream {k}" for k in range(6)]
        expected = {p: alone(chat_of(p), 120).text for p in long}
        with cf.ThreadPoolExecutor(6) as pool:
            started = []
            futures = [pool.submit(stream, url, p, 120, started) for p in long]
            victim = sorted(pids)[0]
            deadline = time.monotonic() + 60
            while len(set(started)) < 2 and time.monotonic() < deadline:  # both replicas are answering a stream
                time.sleep(0.02)
            killed = time.monotonic()
            os.kill(pids[victim], signal.SIGKILL)
            results = [f.result(timeout=180) for f in futures]
        whole = [r[0] == 200 and r[3] and r[2] == expected[p] for p, r in zip(long, results)]
        for ok, r in zip(whole, results):
            if r[1] is not None and r[1] != victim:
                assert ok, (victim, results)  # the other replica's streams finished as if alone
            elif r[1] == victim and r[4] > killed:
                assert not ok, (victim, results)  # those in flight on the dead one failed (cut short)
            elif r[1] is None:
                assert r[0] is None or r[0] >= 500, (victim, results)  # or were answered an error by the proxy
        assert any(r[1] == victim and r[4] > killed for r in results), results  # one was in flight when it died
        assert any(whole), results  # the other replica served some

        # Ray restarts the dead replica; afterwards every request succeeds again
        deadline = time.monotonic() + 120
        while True:
            now = instances(url, tries=20)
            if len(now) == 2 and pids[victim] not in now.values():
                break
            assert time.monotonic() < deadline, now
            time.sleep(1)
        for p in prompts:
            out = c.chat.completions.create(model="tiny", messages=chat_of(p), max_tokens=12, temperature=0)
            assert out.choices[0].message.content == alone(chat_of(p), 12).text

