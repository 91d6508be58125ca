"""The client finds every family's expert tensors as the daemon does: one digest on both sides.

For every MoE family transformers writes (``tests/tiny_families``: per-expert, stacked,
DBRX's ``[E*I, H]``, shared experts beside routed ones), the daemon's digest of the
checkpoint (``k3d.sources.digest`` on the real source, no ``--pattern``) equals the
client's from the same files (``k3client.local_experts``, guided only by what ``hello``
says), and another seed of the same family is told apart by its bytes.
"""

import pytest

pytest.importorskip("transformers")

from k3client.digest import first_difference  # noqa: E402
from k3client.local_experts import digest as local_digest  # noqa: E402
from k3d.sources import open_source  # noqa: E402
from k3d.sources.digest import for_source  # noqa: E402
from tests import tiny_families as tf  # noqa: E402


@pytest.mark.parametrize("model_type", sorted(tf.EXPECTED))
def test_client_and_daemon_agree_and_tell_another_seed(model_type, tmp_path):
    a = tf.write(model_type, str(tmp_path / "a"), seed=0)
    b = tf.write(model_type, str(tmp_path / "b"), seed=1)
    src = open_source(a, "")
    try:
        served = for_source(src, "", threads=2)
        model = src.describe()
        assert local_digest(a, model, src.layout_of)["hex"] == served["hex"]
        assert "holds other bytes" in first_difference(served, local_digest(b, model, src.layout_of))
    finally:
        src.close()
