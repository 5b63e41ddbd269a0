"""Bad input ends cleanly: exit code 2 and one ``error: ...`` paragraph that names the key and
the rule, never a traceback, for train.py, ``python -m ulysses_jax.plan`` and ``.plot``.

The tables call each CLI's ``main(argv)`` in this process (an exception escaping it would be the
traceback); a few cases also run as real processes, as a user would.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.utils.configs import ROOT, SMALL, TINY
from tests.utils.devices import DEVICES, cli_env
from ulysses_jax import plan, plot

sys.path.insert(0, ROOT)
import train as cli  # noqa: E402

LLAMA = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2}

pytestmark = pytest.mark.skipif(DEVICES[0].platform != "cpu",
                                reason="the CLI tests run on fake CPU devices")


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    return path


def _tokenizer(path, n, eos=True):
    """A word-level tokenizer.json with n words (plus </s> if ``eos``) and [UNK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(n)} | ({"</s>": n} if eos else {})
    vocab["[UNK]"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every bad file of the tables, named by the {placeholders} the cases use."""
    d = str(tmp_path_factory.mktemp("bad"))
    p = lambda *names: os.path.join(d, *names)  # noqa: E731
    text = "def f(x):\n    return x + 1\n" * 40
    hf_dir = lambda name, cfg: _write(p(name, "config.json"), cfg) and p(name)  # noqa: E731
    return {
        "corpus": _write(p("corpus", "a.txt"), text),
        "bad_yaml": _write(p("bad.yaml"), "seq_len: [1, 2\nsteps: 3\n"),
        "list_yaml": _write(p("list.yaml"), "- seq_len\n- steps\n"),
        "binary_yaml": _write(p("binary.yaml"), b"\xff\xfe\x00"),
        "mesh_yaml": _write(p("mesh.yaml"), "mesh: 3\n"),
        "dup_yaml": _write(p("dup.yaml"), "seq_len: 64\nseq_len: 128\n"),
        "dir": d,
        "no_text": _write(p("no_text.jsonl"), '{"text": "a b"}\n{"body": "x"}\n'),
        "int_text": _write(p("int_text.jsonl"), '{"text": 7}\n'),
        "bad_json": _write(p("bad_json.jsonl"), '{"text": "a"}\n\n{"text": "b"\n'),
        "latin1": _write(p("latin1.jsonl"), b'{"text": "caf\xe9"}\n'),
        "list_line": _write(p("list_line.jsonl"), '["text", "a"]\n'),
        "csv": _write(p("data.csv"), "a,b\n"),
        "empty_txt": _write(p("empty", "e.txt"), ""),
        "bad_tok": _write(p("badtok", "tokenizer.json"), '{"model": 3'),
        "big_tok": _tokenizer(p("bigtok", "tokenizer.json"), 300),
        "no_eos_tok": _tokenizer(p("noeos", "tokenizer.json"), 20, eos=False),
        "bad_tok_cfg": (_tokenizer(p("badcfg", "tokenizer.json"), 20),
                        _write(p("badcfg", "tokenizer_config.json"), "{eos"))[0],
        "a_file": _write(p("a_file"), "not a directory\n"),
        "bad_store": os.path.dirname(_write(p("bad_store", "manifest.json"), "{")),
        "old_store": os.path.dirname(_write(p("old_store", "manifest.json"), json.dumps(
            {"format": "ulysses-jax-token-store", "version": 0}))),
        "hf_bad_json": hf_dir("hf_bad_json", "{"),
        "hf_list": hf_dir("hf_list", "[1, 2]"),
        "hf_gpt2": hf_dir("hf_gpt2", json.dumps(LLAMA | {"model_type": "gpt2"})),
        "hf_no_weights": hf_dir("hf_no_weights", json.dumps(LLAMA)),
        "hf_bad_weights": (hf_dir("hf_bad_weights", json.dumps(LLAMA)),
                           _write(p("hf_bad_weights", "model.safetensors"), b"\x10garbage"))[0],
    }


BASE = ["--config", TINY, "--no-progress", *SMALL, "data.source={corpus}", "steps=2",
        "eval_batches=0"]

# (id, arguments after BASE (a later --config or key wins), strings the message must hold:
# the key and the rule). "{x}" is the path files["x"]; "{workdir}" a fresh directory.
TRAIN_CASES = [
    # config files
    ("yaml_invalid", ["--config", "{bad_yaml}"], ["--config", "invalid YAML at line 2"]),
    ("yaml_list", ["--config", "{list_yaml}"], ["--config", "top level must be a mapping"]),
    ("yaml_directory", ["--config", "{dir}"], ["--config", "is a directory"]),
    ("yaml_missing", ["--config", "{dir}/nope.yaml"], ["--config", "file not found"]),
    ("yaml_not_utf8", ["--config", "{binary_yaml}"], ["--config", "is not UTF-8"]),
    ("yaml_section_value", ["--config", "{mesh_yaml}"], ["'mesh'", "must hold keys"]),
    ("yaml_duplicate_key", ["--config", "{dup_yaml}"], ["duplicate key seq_len"]),
    # overrides
    ("unknown_key", ["foo.bar=1"], ["'foo'", "not in 'Config'"]),
    ("wrong_type", ["steps=many"], ["'steps'", "could not be converted to Integer"]),
    ("no_equals", ["steps"], ["'steps'", "not of the form key=value"]),
    ("empty_key", ["=5"], ["'=5'", "must be a dotted name"]),
    ("value_not_yaml", ["seq_len=[1"], ["'seq_len=[1'", "not valid YAML"]),
    ("section_value", ["mesh=3"], ["'mesh'", "must hold keys"]),
    ("dtype_choice", ["model.dtype=float8"], ["model.dtype", "must be one of float32"]),
    ("seq_not_divisible", ["mesh.seq=3"], ["mesh.seq 3", "not divisible"]),
    ("too_many_devices", ["mesh.data=2", "batch_size=4"], ["mesh.data 2", "only 8 are available"]),
    ("accum_split", ["batch_size=6", "grad_accum_steps=4"],
     ["batch_size 6", "grad_accum_steps 4", "grad_accum_steps x mesh.data = 4 x 1 = 4"]),
    ("accum_zero", ["grad_accum_steps=0"], ["grad_accum_steps must be positive, got 0"]),
    # numbers
    ("lr_negative", ["optimizer.lr=-0.1"], ["optimizer.lr", "must be positive, got -0.1"]),
    ("lr_nan", ["optimizer.lr=nan"], ["optimizer.lr", "must be a finite number, got nan"]),
    ("lr_inf", ["optimizer.lr=inf"], ["optimizer.lr", "must be a finite number, got inf"]),
    ("warmup_negative", ["optimizer.warmup_steps=-5"],
     ["optimizer.warmup_steps", "must be 0 or positive, got -5"]),
    ("checkpoint_every_negative", ["checkpoint_every=-3"],
     ["checkpoint_every", "must be 0 (final step only) or positive, got -3"]),
    ("seq_len_int32", ["--dry-run", "seq_len=10000000000"],
     ["seq_len", "must be at most 2147483647", "10000000000"]),
    ("steps_int32", ["steps=2147483648"], ["steps", "must be at most 2147483647"]),
    ("steps_zero", ["steps=0"], ["steps", "must be positive, got 0"]),
    ("seed_negative", ["seed=-1"], ["seed", "must be 0 or positive, got -1"]),
    ("b2_range", ["optimizer.b2=1.5"], ["optimizer.b2", "must be in [0, 1), got 1.5"]),
    ("heldout_range", ["data.heldout_fraction=1.0"], ["data.heldout_fraction", "[0, 1)"]),
    ("keep_zero", ["keep_checkpoints=0"], ["keep_checkpoints", "must be positive, got 0"]),
    ("init_std_nan", ["model.init_std=nan"], ["model.init_std", "must be a finite number"]),
    ("eval_every_negative", ["eval_every=-1"], ["eval_every", "must be 0 (final step only)"]),
    ("clip_norm_zero", ["optimizer.clip_norm=0"], ["optimizer.clip_norm", "must be positive"]),
    # data
    ("jsonl_no_text", ["data.source={no_text}"],
     ["data.source", "{no_text}:2", 'must be an object with a "text" field']),
    ("jsonl_text_not_string", ["data.source={int_text}"],
     ["data.source", "{int_text}:1", '"text" must be a string, got int']),
    ("jsonl_not_json", ["data.source={bad_json}"],
     ["data.source", "{bad_json}:3", "not valid JSON"]),
    ("jsonl_not_utf8", ["data.source={latin1}"], ["data.source", "{latin1}:1", "not UTF-8"]),
    ("jsonl_not_object", ["data.source={list_line}"],
     ["data.source", "{list_line}:1", "must be an object"]),
    ("source_no_match", ["data.source={dir}/nothing/*.txt"], ["data.source", "matches no file"]),
    ("source_file_type", ["data.source={csv}"], ["data.source", "unsupported file type"]),
    ("source_empty", ["data.source={empty_txt}"], ["data.source", "no non-empty document"]),
    ("chat_overflow_choice", ["data.chat_overflow=cut"],
     ["data.chat_overflow", "must be 'truncate' or 'drop', got 'cut'"]),
    ("store_damaged", ["data.source={bad_store}"],
     ["data.source", "not a readable token store"]),
    ("store_other_version", ["data.source={old_store}"],
     ["data.source", "version 0", "prepare the store again"]),
    # tokenizer
    ("tokenizer_corrupt", ["data.tokenizer={bad_tok}"],
     ["data.tokenizer", "is not a tokenizer.json the tokenizers package can read"]),
    ("tokenizer_missing", ["data.tokenizer={dir}/none.json"], ["data.tokenizer", "does not exist"]),
    ("tokenizer_dir_without_file", ["data.tokenizer={dir}"], ["data.tokenizer", "does not exist"]),
    ("tokenizer_no_eos", ["data.tokenizer={no_eos_tok}"], ["data.tokenizer", "no EOS token"]),
    ("tokenizer_config_not_json", ["data.tokenizer={bad_tok_cfg}"],
     ["data.tokenizer", "tokenizer_config.json is not valid JSON"]),
    ("tokenizer_too_big", ["data.tokenizer={big_tok}"],
     ["model.vocab_size", "the tokenizer has 302 ids"]),
    # kernels this machine or this model cannot run (the kernel would refuse while tracing)
    ("kernel_cudnn_on_cpu", ["model.attn_impl=cudnn"],
     ["model.attn_impl=cudnn", "needs a GPU backend, but the backend is 'cpu'"]),
    ("kernel_xla_softcap", ["model.attn_impl=xla", "model.attn_softcap=30"],
     ["model.attn_impl=xla", "cannot apply a logit softcap (30.0)"]),
    # paths
    ("workdir_is_file", ["--workdir", "{a_file}"], ["--workdir", "is a file, not a directory"]),
    ("workdir_not_creatable", ["--workdir", "{a_file}/run"], ["--workdir", "cannot be created"]),
    # init_from
    ("init_from_missing", ["init_from={dir}/no_model"], ["init_from", "has no config.json"]),
    ("init_from_bad_json", ["init_from={hf_bad_json}"],
     ["init_from", "config.json is not valid JSON"]),
    ("init_from_list", ["init_from={hf_list}"],
     ["init_from", "config.json must hold a JSON object"]),
    ("init_from_arch", ["init_from={hf_gpt2}"], ["init_from", "model_type 'gpt2' is not supported"]),
    ("init_from_no_weights", ["init_from={hf_no_weights}"],
     ["init_from", "has neither model.safetensors"]),
    ("init_from_bad_weights", ["init_from={hf_bad_weights}"],
     ["init_from", "weights are not a readable safetensors file"]),
    # multi-process options
    ("processes_without_coordinator", ["--num-processes", "2"],
     ["--num-processes", "needs --coordinator HOST:PORT"]),
    ("coordinator_alone", ["--coordinator", "127.0.0.1:1234"],
     ["--coordinator", "needs --num-processes and --process-id"]),
    ("process_id_range", ["--coordinator", "127.0.0.1:1234", "--num-processes", "2",
                          "--process-id", "2"], ["--process-id", "must be in [0, --num-processes)"]),
    ("coordinator_format", ["--coordinator", "localhost", "--num-processes", "2",
                            "--process-id", "0"], ["--coordinator", "must be HOST:PORT"]),
]


def _fill(items, files, workdir):
    return [s.format(workdir=workdir, **files) for s in items]


def _one_error_paragraph(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_the_table_is_large_enough():
    assert len(TRAIN_CASES) >= 40 and len({c[0] for c in TRAIN_CASES}) == len(TRAIN_CASES)


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_bad_input(case, files, tmp_path, capsys):
    _, extra, expected = case
    argv = _fill(["--workdir", "{workdir}", *BASE, *extra], files, str(tmp_path / "run"))
    rc = cli.main(argv)
    message = _one_error_paragraph(capsys.readouterr().err)
    assert rc == 2, message
    for part in _fill(expected, files, str(tmp_path / "run")):
        assert part in message, (part, message)


@pytest.mark.parametrize("argv", [["--bogus"], ["--num-processes", "two"]])
def test_train_argparse_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--config", TINY, *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error:" in err and "Traceback" not in err, err


def test_overrides_on_both_sides_of_options(capsys):
    args = cli.parse_args(["--config", TINY, "seq_len=128", "--workdir", "w", "steps=20",
                           "--no-progress"])
    assert args.overrides == ["seq_len=128", "steps=20"] and args.workdir == "w"
    # A bad override before an option is read, not rejected as an unknown argument.
    rc = cli.main(["--config", TINY, "optimizer.lr=-1", "--dry-run", "steps=3"])
    assert rc == 2 and "optimizer.lr must be positive, got -1" in capsys.readouterr().err


PLAN_CASES = [
    ("yaml_invalid", ["--config", "{bad_yaml}"], ["--config", "invalid YAML at line 2"]),
    ("yaml_list", ["--config", "{list_yaml}"], ["--config", "top level must be a mapping"]),
    ("yaml_directory", ["--config", "{dir}"], ["--config", "is a directory"]),
    ("memory_negative", ["--memory-gb", "-2"], ["--memory-gb", "must be a positive number"]),
    ("memory_nan", ["--memory-gb", "nan"], ["--memory-gb", "must be a positive number"]),
    ("p_words", ["--p", "two"], ["--p", "comma-separated positive integers"]),
    ("p_zero", ["--p", "0"], ["--p", "comma-separated positive integers"]),
    ("granularity_zero", ["--granularity", "0"], ["--granularity", "must be a positive integer"]),
    ("max_below_unit", ["--max-seq-len", "10"], ["--max-seq-len 10", "below the search unit"]),
    # heads that P does not divide are padded (head_layout.py); experts must divide
    ("p_experts", ["--p", "1,3", "model.num_experts=8"], ["P=3", "num_experts 8",
                                                          "not divisible by the mesh's 3"]),
    ("lr_negative", ["optimizer.lr=-1"], ["optimizer.lr", "must be positive"]),
    ("unknown_key", ["model.no_such_key=1"], ["no_such_key", "not in"]),
]


@pytest.mark.parametrize("case", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_bad_input(case, files, capsys):
    _, extra, expected = case
    rc = plan.main(_fill(["--config", TINY, "--memory-gb", "1", *extra], files, ""))
    message = _one_error_paragraph(capsys.readouterr().err)
    assert rc == 2, message
    for part in _fill(expected, files, ""):
        assert part in message, (part, message)


def _metrics_dir(tmp_path, text):
    _write(str(tmp_path / "run" / "metrics.jsonl"), text)
    return str(tmp_path / "run")


PLOT_CASES = [
    ("workdir_missing", lambda t: ["{dir}/no_run"], ["WORKDIR", "not a directory"]),
    ("no_metrics", lambda t: ["{dir}"], ["WORKDIR", "has no metrics.jsonl"]),
    ("damaged_line", lambda t: [_metrics_dir(t, '{"step": 1, "loss": 2}\n{"step": 2,\n'
                                                '{"step": 3, "loss": 1}\n')],
     ["metrics.jsonl:2", "not a JSON record"]),
    ("no_step", lambda t: [_metrics_dir(t, '{"loss": 2}\n')],
     ["metrics.jsonl:1", 'integer "step"']),
    ("no_loss", lambda t: [_metrics_dir(t, '{"step": 1, "lo')], ["metrics.jsonl", "no logged loss"]),
    ("out_dir_missing", lambda t: [_metrics_dir(t, '{"step": 1, "loss": 2}\n'), "--out",
                                   "{dir}/nowhere/loss.png"], ["--out", "No such file or directory"]),
    ("out_format", lambda t: [_metrics_dir(t, '{"step": 1, "loss": 2}\n'), "--out",
                              str(t / "loss.xyz")], ["--out", "'xyz' is not supported"]),
]


@pytest.mark.parametrize("case", PLOT_CASES, ids=[c[0] for c in PLOT_CASES])
def test_plot_bad_input(case, files, tmp_path, capsys):
    _, argv, expected = case
    rc = plot.main(_fill(argv(tmp_path), files, ""))
    message = _one_error_paragraph(capsys.readouterr().err)
    assert rc == 2, message
    for part in _fill(expected, files, ""):
        assert part in message, (part, message)


@pytest.mark.parametrize("module,argv", [(plan, ["--memory-gb", "1"]), (plot, ["--bogus", "x"])])
def test_plan_and_plot_argparse_errors_exit_2(module, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error:" in err and "Traceback" not in err, err


def test_plot_leaves_out_an_unfinished_last_line(tmp_path):
    run = _metrics_dir(tmp_path, '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n{"step": 3')
    assert plot.main([run]) == 0
    with open(os.path.join(run, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,expected", [
    (["train.py", "--config", "{bad_yaml}"], "invalid YAML at line 2"),
    (["train.py", *BASE, "--workdir", "{dir}/sub", "data.source={no_text}"], "{no_text}:2"),
    (["-m", "ulysses_jax.plan", "--config", "{bad_yaml}", "--memory-gb", "1"], "invalid YAML"),
    (["-m", "ulysses_jax.plot", "{dir}/no_run"], "not a directory"),
], ids=["train_yaml", "train_jsonl", "plan_yaml", "plot_workdir"])
def test_real_processes_print_one_paragraph(argv, expected, files):
    """As a user runs them: the process's whole stderr is the one paragraph."""
    env = cli_env()
    out = subprocess.run([sys.executable, *_fill(argv, files, "")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    message = _one_error_paragraph(out.stderr)
    assert out.returncode == 2 and _fill([expected], files, "")[0] in message, out.stderr
