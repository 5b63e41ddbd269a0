"""The objective as an interface (training/objectives/base.py): the registry resolves every
name, the loop and the run never ask which objective runs, each objective refuses the data
of another, and an objective written outside the package (one module and a registry line)
trains through the same loop."""
import ast
import json
import os

import pytest

from tests.utils.configs import SMALL, tiny_config
from tests.utils.devices import DEVICES
from ulysses_jax import config as config_lib
from ulysses_jax.config import ConfigError, load_config
from ulysses_jax.data import prepare as prepare_lib
from ulysses_jax.training import objectives
from ulysses_jax.training.objectives.base import Objective
from ulysses_jax.training.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING = os.path.join(ROOT, "ulysses_jax", "training")
pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="trainer tests run on fake CPU devices")


def _cfg(*over):
    return tiny_config(*SMALL, "checkpoint_every=0", *over)


def test_every_registered_name_is_an_objective_of_that_name():
    for name in config_lib.OBJECTIVES:
        over = [f"objective={name}"] + (["seq_len=512"] if name == "grpo" else [])
        objective = objectives.get(load_config(None, over))
        assert isinstance(objective, Objective) and objective.name == name
        assert objective.weighting in ("tokens", "equal", "sum")
        assert objective.batch_line().startswith("batch: ")


@pytest.mark.parametrize("module", ["loop.py", "trainer.py", "train_step.py"])
def test_the_loop_and_the_run_never_ask_which_objective_runs(module):
    """No ``.objective`` read, no objective section (``cfg.dpo``, ``cfg.grpo``) and no
    objective's name as a string in the modules every objective runs through."""
    tree = ast.parse(open(os.path.join(TRAINING, module)).read())
    asked = [f"line {n.lineno}: .{n.attr}" for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and n.attr in ("objective", "dpo", "grpo")]
    asked += [f"line {n.lineno}: {n.value!r}" for n in ast.walk(tree)
              if isinstance(n, ast.Constant) and n.value in config_lib.OBJECTIVES]
    assert not asked, asked


def _preference_store(tmp_path):
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"prompt": "p" * 10, "chosen": "c" * 5,
                                       "rejected": "r" * 7}) + "\n" for _ in range(8)))
    prepare_lib.prepare([str(src)], str(tmp_path / "store"), None, preference=True,
                        progress=False)
    return str(tmp_path / "store")


def test_each_objective_refuses_the_data_of_another(tmp_path):
    store = _preference_store(tmp_path)
    with pytest.raises(ConfigError, match=r"is a preference store \(prompt, chosen, rejected "
                                          r"pairs\); train it with objective=dpo, got "
                                          r"objective=sft"):
        train(_cfg("steps=1", f"data.source={store}"), str(tmp_path / "a"), progress=False)
    with pytest.raises(ConfigError, match=r"objective=dpo trains on preference pairs, but "
                                          r"data.source 'stdlib' is text files, tokenized on "
                                          r"the fly; prepare one with"):
        train(_cfg("steps=1", "objective=dpo"), str(tmp_path / "b"), progress=False)
    assert not os.path.exists(tmp_path / "a" / "checkpoints" / "1")


EXTRA = '''
from ulysses_jax.training.objectives import sft


class Doubled(sft.SFT):
    """Twice the next-token loss: the same run with each gradient doubled, and a metric."""

    name = "doubled"

    def metrics(self):
        return ("half",)

    def loss(self, graphdef, params, batch, mesh, weights=None):
        objective, (loss, metrics) = super().loss(graphdef, params, batch, mesh, weights)
        return 2 * objective, (2 * loss, {**metrics, "half": loss})

    def line(self, record):
        return f", half {record['half']:.4f}" + super().line(record)


OBJECTIVE = Doubled
'''


def test_an_objective_outside_the_package_is_a_module_and_a_registry_line(tmp_path,
                                                                            monkeypatch,
                                                                            capsys):
    (tmp_path / "doubled_objective.py").write_text(EXTRA)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(config_lib.OBJECTIVES, "doubled", "doubled_objective")
    over = ["steps=1"]  # step 1's loss and gradient: both runs see the same parameters
    train(_cfg(*over), str(tmp_path / "sft"), progress=False)
    summary = train(_cfg(*over, "objective=doubled"), str(tmp_path / "doubled"),
                    progress=False)
    read = lambda d: [json.loads(l) for l in open(tmp_path / d / "metrics.jsonl")]  # noqa: E731
    sft_run, doubled = read("sft"), read("doubled")
    assert [r["step"] for r in doubled] == [1] and summary["step"] == 1
    for a, b in zip(sft_run, doubled):
        assert b["loss"] == pytest.approx(2 * a["loss"], rel=1e-6)
        assert b["half"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(2 * a["grad_norm"], rel=1e-5)
    assert doubled[-1]["eval_loss"] is not None  # the held-out pass of the SFT's batches
    assert f", half {doubled[0]['half']:.4f}" in capsys.readouterr().out
