"""``--model owner/name``: a Hugging Face model id, read as its config.json from the local cache or the hub.

The hub cannot be reached from here, so the tests lay out a Hugging Face cache
themselves (as ``hf download`` leaves it) and serve the hub's resolve protocol
from a local HTTP server (``HF_ENDPOINT``): huggingface_hub's real client,
real requests, real error headers.
"""

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import run_cli

FAMILIES = Path(__file__).parent / "families"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(home: Path, model_id: str, config: Path) -> Path:
    """A Hugging Face cache holding ``model_id``'s config.json at ``main``, as a download leaves it."""
    repo = home / "hub" / f"models--{model_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(config.read_text())
    return snapshot / "config.json"


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The hub's ``/{repo}/resolve/{revision}/{file}`` with the error codes its client reads."""

    served: dict[str, bytes] = {}
    requests: list[str] = []

    def _answer(self, body: bool) -> None:
        FakeHub.requests.append(self.path)
        repo, _, rest = self.path.lstrip("/").partition("/resolve/")
        if repo in self.served and rest.endswith("/config.json"):
            content = self.served[repo]
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha1(content).hexdigest()}"')
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            if body:
                self.wfile.write(content)
            return
        code, error = {"gated": (401, "GatedRepo"), "noconfig": (404, "EntryNotFound")}.get(repo.split("/")[-1],
                                                                                              (404, "RepoNotFound"))
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("X-Error-Message", "from the test's hub")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's names)
        self._answer(False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(True)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hub():
    FakeHub.served = {"acme/served": (FAMILIES / "qwen2.json").read_bytes()}
    FakeHub.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def hf_env(home: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(home), **more}


def resolve(model: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """parse_model_spec in a process of its own: huggingface_hub reads HF_* when it is imported."""
    code = "import dataclasses, json, sys; from autotune.presets import parse_model_spec; " \
           "print(json.dumps(dataclasses.asdict(parse_model_spec(sys.argv[1]))))"
    return subprocess.run([sys.executable, "-c", code, model], env=env, capture_output=True, text=True, timeout=60)


def test_a_hub_id_resolves_offline_from_the_cache(tmp_path):
    cached = lay_out_cache(tmp_path / "hf", "acme/tiny-llama", FAMILIES / "llama.json")
    done = resolve("acme/tiny-llama", hf_env(tmp_path / "hf", HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr
    spec = json.loads(done.stdout)
    assert spec == {"kind": "config_file", "value": str(cached), "hub_id": "acme/tiny-llama"}


def test_a_hub_id_not_cached_downloads_its_config_json_and_nothing_else(tmp_path, hub):
    done = resolve("acme/served", hf_env(tmp_path / "hf", HF_ENDPOINT=hub))
    assert done.returncode == 0, done.stderr
    path = Path(json.loads(done.stdout)["value"])
    assert path.is_relative_to(tmp_path / "hf") and json.loads(path.read_text())["model_type"] == "qwen2"
    assert FakeHub.requests and all(r.split("?")[0].endswith("/config.json") for r in FakeHub.requests
                                    if "/resolve/" in r), FakeHub.requests
    # Then offline, from the cache it left.
    again = resolve("acme/served", hf_env(tmp_path / "hf", HF_HUB_OFFLINE="1"))
    assert again.returncode == 0 and json.loads(again.stdout)["value"] == str(path)


@pytest.mark.parametrize("model_id, says", [
    ("acme/gated", "gated model"),
    ("acme/missing", "no such model on the Hugging Face hub"),
    ("acme/noconfig", "has no config.json"),
])
def test_a_gated_missing_or_configless_id_is_one_line_and_exit_2(tmp_path, hub, model_id, says):
    done = run_cli("run", "--mem-budget", "1GB", "--model", model_id, cwd=tmp_path,
                   env=hf_env(tmp_path / "hf", HF_ENDPOINT=hub))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line, = done.stderr.strip().splitlines()
    assert says in line and model_id in line and ("config.json" in line)
    assert not (tmp_path / "studies").exists(), "a refused run wrote a study"


def test_offline_and_not_cached_says_so(tmp_path):
    done = run_cli("estimate", "--mem-budget", "1GB", "--model", "meta-llama/Llama-3.1-8B", cwd=tmp_path,
                   env=hf_env(tmp_path / "hf", HF_HUB_OFFLINE="1"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "not in the Hugging Face cache" in done.stderr and "config.json" in done.stderr


@pytest.mark.torchrun
def test_a_study_of_a_hub_model_is_the_id_and_its_trials_build_the_cached_config(tmp_path):
    """End to end: the study's identity and export name the id; the trial built the config from the cache."""
    lay_out_cache(tmp_path / "hf", "acme/tiny-llama", FAMILIES / "llama.json")
    env = hf_env(tmp_path / "hf", HF_HUB_OFFLINE="1")
    done = run_cli("run", "--mem-budget", "1GB", "--model", "acme/tiny-llama", "--seq-len", "32", "--trials", "1",
                   "--confirm", "0", "--no-estimate", "--space", "smoke", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "tiny-llama-w2-s32-1GB" in done.stderr
    export = run_cli("export", cwd=tmp_path, env=env)
    assert export.returncode == 0, export.stderr
    assert json.loads(export.stdout)["model"] == "acme/tiny-llama"
    # Resuming under the id names the same study (nothing to redo: one trial was asked for).
    again = run_cli("run", "--mem-budget", "1GB", "--model", "acme/tiny-llama", "--seq-len", "32", "--trials", "1",
                    "--confirm", "0", "--no-estimate", "--space", "smoke", cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr
