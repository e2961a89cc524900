"""ACP-SGD converges like uncompressed training on real data (scikit-learn's digits, 2 ranks), and
error feedback is what makes it (acp-sgd Fig. 7 ablation)."""
from functools import partial

from gradsync.launch import run_local
from gradsync.recipes.classification import fit
from runtime_models import COST

EPOCHS = 8


def final_accuracy(compressor):
    # a given cost model spares the network probes; whatever plan it gives, the ops sum the same gradients
    results = run_local(partial(fit, cost=COST), 2, "cnn", "digits", EPOCHS, "optimal_merge", compressor)
    assert results[0]["accuracy"] == results[1]["accuracy"]  # replicas stay identical
    return results[0]["accuracy"][-1]


def test_acp_sgd_matches_uncompressed_accuracy_and_needs_error_feedback():
    plain = final_accuracy(None)
    acp = final_accuracy({"type": "acp_sgd", "rank": 4})
    without_feedback = final_accuracy({"type": "acp_sgd", "rank": 4, "error_feedback": False})
    assert plain > 90
    assert abs(acp - plain) <= 1.5, (plain, acp)
    assert without_feedback < acp - 2, (acp, without_feedback)
