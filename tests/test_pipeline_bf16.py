"""Pipeline stages in bf16 train like one device in bf16: the first steps of tiny (3 layers, MTP
on) from the same parameters and batches (helpers from tests/test_pipeline.py; a file of its
own so the suite's workers can run it beside that one)."""

import jax
import numpy as np
import pytest
from test_pipeline import batches, config_of

from maxmoe.parallel.layout import build_layout
from maxmoe.training import stage_state
from maxmoe.training.programs import build_programs


@pytest.mark.slow
def test_bfloat16_steps_match_one_device():
    """bf16 compute: the outer weights reach the stages as a bf16 copy gathered over `pipeline`
    (their master weights ZeRO-1 over the stages), the stack's as the model casts them. The
    pipeline (one chunk per stage, [D0 M0 | M1 -]: a layout test_pipeline.py does not take)
    against one device's bf16 steps from the same parameters and batches.

    Both programs round the same values to bf16; what differs is the order of float32 sums
    (micro-batches, experts, stages), so step 1, from equal parameters, agrees to within bf16's
    unit roundoff 2^-8, and so does step 2's loss. Later gradient norms are left out: after an
    AdamW step, elements with gradients near Adam's eps turn those differences into larger ones.
    """
    bf16 = ["model.compute_dtype=bfloat16", "model.num_layers=3"]
    one = Stepper(config_of(bf16 + ["mesh.data=1"]))
    pipe = Stepper(config_of(bf16 + ["mesh.pipeline=2", "mesh.data=2", "mesh.expert=2", "moe.dispatch=ragged_a2a"]))
    start = jax.device_get(one.programs.init(jax.random.key(0)))
    got, want = pipe.run(start, 2), one.run(start, 2)
    u = 2.0**-8
    for key in ("loss", "lm_loss", "mtp_loss", "seq_aux", "grad_norm"):
        np.testing.assert_allclose(got[0][key], want[0][key], rtol=u, err_msg=f"step 1 {key}")
    np.testing.assert_allclose(got[1]["loss"], want[1]["loss"], rtol=u, err_msg="step 2 loss")


class Stepper:
    """A config's programs on the first devices it needs: `run(start, n)` -> n steps' metrics
    from `start` (model order, host arrays) on `batches()`."""

    def __init__(self, config):
        m = config.mesh
        self.config = config
        self.programs = build_programs(config, build_layout(config, jax.devices()[: m.pipeline * m.data * m.expert]))

    def run(self, start, steps):
        state = stage_state.to_stage_order(self.config, start, self.programs.abstract_state)
        metrics = []
        for batch in batches()[:steps]:
            state, m = self.programs.train_step(state, jax.device_put(batch, self.programs.batch_sharding))
            metrics.append(jax.device_get(m))
        return metrics
