"""The agent CLIs users point at a local model, installed from npm (`.ci/run`: `npm ci --prefix
tests/clients`), each completing turns against a real `tandem serve` process: Claude Code
(`claude -p`, Anthropic's Messages API, streamed) and Codex (`codex exec`, the Responses API,
streamed).

The model is SmolLM2-135M-Instruct, greedy, its replies capped at 64 tokens by the server.
Each CLI runs twice:
- with a short system prompt of the user's choice (`claude --bare --system-prompt`, Codex's
  `model_instructions_file`): the model answers and ends its turn, and the CLI exits 0 with the
  answer and no error;
- as it comes, with its own prompts (Claude Code's 80 KB request of 25 tools, a system
  prompt in blocks, system messages mid-conversation, `thinking`, `context_management`,
  `output_config`, `metadata`; Codex's 40 KB of developer messages, function, namespace and
  web-search tools, `reasoning`, `include`, `store: false`): every request is answered, and
  the CLI either prints the answer or reports, in its own words, that the answer reached the
  output cap. So small a model rarely ends its turn under prompts written for frontier models,
  and each CLI rightly treats a capped answer as an error; a request refused or a stream it
  could not read would be any other message.
Without the CLIs installed the tests skip with the install command (they fail where
TANDEM_REQUIRE_AGENT_CLIS is set, as in CI).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server_processes import Served, serving

from helpers import packaged_model

CLIENTS = Path(__file__).with_name("clients") / "node_modules" / ".bin"
MODEL = "smollm2-135m-instruct"
CAP = 128
INSTRUCTIONS = "You are a friendly assistant. Answer in one short sentence."
TIMEOUT_S = 240
# What each CLI says, and nothing else, when the answer reached the output cap.
CLAUDE_CAPPED = "API Error: Claude's response exceeded the"
CODEX_CAPPED = "Incomplete response returned, reason: max_output_tokens"


def cli(name: str) -> Path:
    path = CLIENTS / name
    if not path.exists():
        message = f"{name} is not installed: npm ci --prefix tests/clients"
        if os.environ.get("TANDEM_REQUIRE_AGENT_CLIS"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    packaged_model(MODEL, "SmolLM2-135M-Instruct")
    cli("claude")
    cli("codex")
    override = f'{{"temperature": 0, "max_new_tokens": {CAP}}}'
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    flags = ("--max-model-len", "8192", "--num-kv-blocks", "1024", "--cpu-threads", "2",
             "--override-generation-config", override)  # fmt: skip
    with serving(MODEL, log, *flags) as served:
        yield served


def run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True,
        timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def claude(server: Served, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    home.mkdir(exist_ok=True)
    return run([str(cli("claude")), *args], env, home)


def codex(server: Served, home: Path, *args: str) -> subprocess.CompletedProcess:
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "tandem"\n\n[model_providers.tandem]\n'
        f'name = "Tandem"\nbase_url = "{server.url}/v1"\nwire_api = "responses"\n'
    )
    env = {"HOME": str(home), "CODEX_HOME": str(home)}
    return run([str(cli("codex")), "exec", "--skip-git-repo-check", *args], env, home)


def errors(out: subprocess.CompletedProcess) -> list[str]:
    text = out.stdout + out.stderr
    return [line for line in text.splitlines() if "error" in line.lower()]


def test_claude_code_completes_a_turn(server: Served, tmp_path: Path) -> None:
    out = claude(server, tmp_path / "home", "--bare", "-p", "--system-prompt", INSTRUCTIONS,
                 "say hi")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() and not errors(out), out.stdout + out.stderr


def test_claude_code_with_its_own_prompts(server: Served, tmp_path: Path) -> None:
    out = claude(server, tmp_path / "home", "-p", "say hi")
    if out.returncode == 0:
        assert out.stdout.strip() and not errors(out), out.stdout + out.stderr
    else:
        assert errors(out) and all(CLAUDE_CAPPED in line for line in errors(out)), out.stdout
        assert out.returncode == 1


def test_codex_completes_a_turn(server: Served, tmp_path: Path) -> None:
    instructions = tmp_path / "instructions.md"
    instructions.write_text(INSTRUCTIONS + "\n")
    out = codex(
        server, tmp_path / "home", "-c", f'model_instructions_file="{instructions}"',
        "-c", "include_environment_context=false", "-c", "include_apps_instructions=false",
        "say hi",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() and not errors(out), out.stdout + out.stderr


def test_codex_with_its_own_prompts(server: Served, tmp_path: Path) -> None:
    out = codex(server, tmp_path / "home", "say hi")
    if out.returncode == 0:
        assert out.stdout.strip() and not errors(out), out.stdout + out.stderr
    else:
        assert errors(out) and all(CODEX_CAPPED in line for line in errors(out)), out.stderr
        assert out.returncode == 1
