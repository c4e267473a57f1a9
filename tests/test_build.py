"""moejax.build: the builders refuse a key they do not read, the parameter count against a
hand-worked one, and the abstract model against the concrete one (docs/design.md §5.1)."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from moejax import build
from moejax import config as config_lib
from moejax.config import reader
from moejax.config import run as run_lib
from moejax.nn.losses import LossConfig
from moejax.errors import UserError
from runconfig import as_run

V = 16
ROWS = 128  # V padded to a multiple of 128 (the embedding's rows)


def tiny(**model):
  """2 layers of d_model 8 (2 query / 1 kv heads of 4), layer 0 MoE (E 4, K 2, width 6),
  layer 1 dense (d_ff 12)."""
  c = config_lib.base_config()
  shape = {"d_model": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "d_ff": 12, "moe_every": 2}
  c.model.update({**shape, **model})
  c.model.moe.update(n_experts=4, top_k=2, d_expert=6)
  return c


@pytest.mark.parametrize(
  "section, build_it",
  [
    ("model.moe", lambda c: reader._moe(c.model)),
    ("model.moe", lambda c: reader._model(c.model)),
    ("model", lambda c: reader._model(c.model)),
    ("loss", lambda c: reader._section(LossConfig, c.loss, "loss", grad_accum=1)),
  ],
)
def test_a_key_no_builder_reads_is_refused_by_name(section, build_it):
  """config.check_keys refuses it first for a user (config.resolve); this is the section
  builders' own guard, for a key added to base_config() but to no dataclass or builder."""
  c = tiny()
  build_it(c)  # every key of base_config() is read
  node = c
  for part in section.split("."):
    node = node[part]
  node.stray_key = 1
  with pytest.raises(UserError, match=rf"^{section}\.stray_key is read by no builder"):
    build_it(c)


def test_the_config_keys_a_builder_reads_elsewhere_are_keys_of_base_config():
  moe, model = config_lib.base_config().model.moe, config_lib.base_config().model
  for key in run_lib.RULE_OVERRIDES:
    assert moe[key] is None  # unset: the named rule's value
  for key in run_lib.RULE_COUNTS:
    assert moe[key] == 0
  assert all(key in model for key in run_lib.MODEL_READ_ELSEWHERE)


def test_defaults_are_the_dataclasses():
  """Hand-copied values: the base config's and the typed configs' defaults agree."""
  c = config_lib.base_config()
  moe = as_run(c).moe
  assert (moe.n_experts, moe.top_k, moe.d_expert, moe.group_size) == (8, 2, 128, None)
  assert c.model.moe.group_size == 0
  loss = as_run(c).with_shards(3).loss
  assert (loss.balance_weight, loss.z_loss_weight, loss.n_shards) == (0.01, 0.001, 3)
  assert (loss.balance_granularity, loss.balance_convention) == ("global_batch", "fraction")


def hand_count(tie: bool) -> tuple[int, int]:
  """(total, active) of `tiny()`, counted by hand: the embedding (and untied head) hold the
  vocabulary padded to a multiple of 128 rows (V = 16 → 128)."""
  D, E, K, F, d_ff, hd = 8, 4, 2, 6, 12, 4
  embed = ROWS * D
  attention = 2 * (D * 2 * hd + 2 * D * 1 * hd + 2 * hd * D)  # q, k, v, o per layer
  norms = 2 * 2 * D + D  # two per layer, and the final one
  dense = 3 * D * d_ff  # layer 1
  router, experts = D * E, 3 * E * D * F  # layer 0
  head = 0 if tie else D * ROWS
  total = embed + attention + norms + dense + router + experts + head
  return total, total - experts + experts * K // E


@pytest.mark.parametrize("tie", [True, False])
def test_count_params_against_a_hand_count(tie):
  c = tiny(tie_embeddings=tie)
  mc = as_run(c).with_vocab(V).model
  params = nnx.state(build.transformer(as_run(c).with_vocab(V).model, as_run(c).train.seed), nnx.Param)
  assert build.count_params(params, mc.moe) == hand_count(tie)
  assert build.count_params(build.abstract_params(mc), mc.moe) == hand_count(tie)


def test_a_dense_model_is_all_active():
  mc = as_run(tiny(moe_every=0)).with_vocab(V).model
  total, active = build.count_params(build.abstract_params(mc), mc.moe)
  assert mc.moe is None and total == active == ROWS * 8 + 2 * 192 + 40 + 2 * 3 * 8 * 12


def test_the_abstract_model_is_the_concrete_one_in_shapes():
  c = tiny()
  graphdef, state = nnx.split(build.transformer(as_run(c).with_vocab(V).model, as_run(c).train.seed))
  abstract_graphdef, abstract_state = nnx.split(build.abstract_transformer(as_run(c).with_vocab(V).model))
  assert abstract_graphdef == graphdef
  leaves, abstract = jax.tree.leaves(state), jax.tree.leaves(abstract_state)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in abstract)
  assert [(x.shape, x.dtype) for x in abstract] == [(x.shape, x.dtype) for x in leaves]
