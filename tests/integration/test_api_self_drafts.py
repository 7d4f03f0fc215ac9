"""The self-speculative proposer (DRAFT_PROPOSER_SELF) over gRPC against the real server and its
default model, calibrated by the `structgen calibrate-self-spec` step the server reads: the
model's draft layers draft, the full model verifies, and the output is the one decoding
without speculation gives."""
import subprocess
import sys

from generation_service.model.layer_skip import load_choice, model_key
from structgen.builtin_models import resolve_builtin
from tests.integration.live_server import ROOT


def ensure_calibrated() -> None:
    """The calibration in the cache the server reads (the user's: the default model is there too);
    made once, by the command a user runs, when none is there yet."""
    if load_choice(model_key(str(resolve_builtin("default")), "default")) is None:
        result = subprocess.run([sys.executable, "-m", "structgen.cli", "calibrate-self-spec", "--model", "default"],
                                cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        assert '"skip_layers"' in result.stdout


def test_self_proposer_drafts_with_the_models_layers_and_keeps_greedy_output(client):
    ensure_calibrated()
    prompt = "Write one sentence about the sea."
    plain = client.generate_text(prompt, max_tokens=40, ignore_eos=True)
    drafted = client.generate_text(prompt, max_tokens=40, ignore_eos=True, num_draft_tokens=4, proposer="self")
    assert drafted.token_ids == plain.token_ids and drafted.text == plain.text
    usage = drafted.usage
    assert 0 < usage.draft_tokens_accepted < usage.draft_tokens_proposed, usage
    assert plain.usage.draft_tokens_proposed == 0
