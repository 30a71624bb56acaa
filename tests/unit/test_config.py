import pytest

from common.config import Config, ConfigError, dump_toml, load_config


def test_defaults_are_valid():
    cfg = load_config(None, environ={})
    assert cfg.actor.group_size >= 2 and cfg.learner.steps >= 1


def test_precedence_file_then_env_then_set(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[learner]\nlr = 0.1\nsteps = 5\n[env]\nname = "letters"\n')
    cfg = load_config(path, ["learner.steps=7"], environ={"OMRL_LEARNER__LR": "0.01", "OMRL_LEARNER__STEPS": "6"})
    assert cfg.learner.lr == 0.01
    assert cfg.learner.steps == 7
    # An empty variable sets nothing: compose passes OMRL_EVAL_EVERY unset as OMRL_LEARNER__EVAL_EVERY="".
    cfg = load_config(path, environ={"OMRL_LEARNER__EVAL_EVERY": "", "OMRL_LEARNER__STEPS": ""})
    assert cfg.learner.eval_every == 20 and cfg.learner.steps == 5


def test_set_parses_toml_literals_and_plain_strings():
    cfg = load_config(None, ['actor.stop=["\\n", "."]', "env.name=letters", "env.options={turns = 3}",
                             "learner.dual_clip=3.0"], environ={})
    assert cfg.actor.stop == ["\n", "."]
    assert cfg.env.name == "letters"
    assert cfg.env.options == {"turns": 3}
    assert cfg.learner.dual_clip == 3.0


@pytest.mark.parametrize("override, field", [
    ("learner.lr=-1", "learner.lr"),
    ("actor.group_size=1", "actor.group_size"),
    ("learner.no_such_knob=1", "learner.no_such_knob"),
    ("learner.algorithm=ppo2", "learner.algorithm"),
    ("actor.update_mode='kept'", "actor.update_mode"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override], environ={})


def test_every_update_mode_is_accepted():
    for mode in ("interrupt", "drain", "keep"):
        assert load_config(None, [f"actor.update_mode='{mode}'"], environ={}).actor.update_mode == mode


def test_the_embedded_redis_is_durable_by_default_and_keeps_weights_out_of_it(tmp_path):
    from deploy.supervisor import prepare

    assert load_config(None, environ={}).redis.embedded_aof == "everysec"
    # The old boolean still reads: true was fsync always, false no file.
    assert load_config(None, ["redis.embedded_aof=true"], environ={}).redis.embedded_aof == "always"
    assert load_config(None, ["redis.embedded_aof=false"], environ={}).redis.embedded_aof == "off"
    with pytest.raises(ConfigError, match=r"redis\.embedded_aof"):
        load_config(None, ["redis.embedded_aof='sometimes'"], environ={})
    model = "model.path='/m'"  # prepare builds the tiny model only where none is named
    cfg = prepare(load_config(None, [f"run.run_dir='{tmp_path}'", model], environ={}))
    assert cfg.weights.dir == str((tmp_path / "weights").resolve())
    # A Redis of the user's (other hosts may run actors), the broadcast or a directory named: left as set.
    for overrides, want in ((["redis.url='redis://h:6379/0'"], None), (["weights.transport='broadcast'"], None),
                            (["weights.dir='/shared'"], "/shared")):
        cfg = prepare(load_config(None, [f"run.run_dir='{tmp_path}'", model, *overrides], environ={}))
        assert cfg.weights.dir == want, overrides


def test_bad_override_syntax_explains_the_form():
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["lr=1"], environ={})
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["learner.lr"], environ={})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, environ={})


def test_cross_field_check():
    with pytest.raises(ConfigError, match="max_tokens must be below actor.max_seq_len"):
        load_config(None, ["actor.max_tokens=300", "actor.max_seq_len=256"], environ={})


def test_constrained_actions_need_the_raw_template():
    with pytest.raises(ConfigError, match=r'actor.constrain_actions .* set actor.action_template = "raw"'):
        load_config(None, ["actor.constrain_actions=true", "actor.action_template=react"], environ={})
    assert load_config(None, ["actor.constrain_actions=true"], environ={}).actor.constrain_actions
    for agent in ("actor.agent='agents.react:rollout'", "actor.agent_url='http://127.0.0.1:9000'"):
        with pytest.raises(ConfigError, match=r"actor.constrain_actions masks .* unset constrain_actions"):
            load_config(None, ["actor.constrain_actions=true", agent], environ={})
    split = ["actor.constrain_actions=true", "learner.ranks=2", "learner.parallel=fsdp2"]
    with pytest.raises(ConfigError, match="actor.constrain_actions: the learner scores .* set learner.vocab_parallel = false"):
        load_config(None, split, environ={})
    assert not load_config(None, [*split, "learner.vocab_parallel=false"], environ={}).learner.vocab_parallel


def test_the_engine_context_may_not_be_shorter_than_an_episode():
    with pytest.raises(ConfigError, match="actor.max_model_len must be at least actor.max_seq_len"):
        load_config(None, ["actor.max_seq_len=512", "actor.max_model_len=256"], environ={})
    assert load_config(None, ["actor.max_seq_len=512", "actor.max_model_len=1024"], environ={}).actor.max_model_len == 1024


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["env.options={turns = 3, alphabet = \"xy\"}", "redis.url=redis://h:1/0",
                             "actor.system_prompt=\"a \\\"quoted\\\"\\nline\""], environ={})
    path = tmp_path / "resolved.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(path, environ={}) == cfg


def test_every_field_is_documented():
    for section in Config.model_fields.values():
        for name, field in section.annotation.model_fields.items():
            assert field.description, f"{section.annotation.__name__}.{name} has no docstring"


@pytest.mark.parametrize("overrides, message", [
    (["learner.dedup_window=10"], "learner.dedup_window must cover"),
    (["redis.ticket_ttl_s=3", "actor.heartbeat_s=2"], "redis.ticket_ttl_s must be at least 3 x actor.heartbeat_s"),
    (["supervisor.restart=always"], "supervisor.restart"),
])
def test_fault_tolerance_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides, environ={})


def test_sync_mode_runs_no_version_ahead_and_bad_modes_are_refused():
    assert load_config(None, ["learner.eta=4"], environ={}).learner.steps_ahead == 4
    assert load_config(None, ["learner.mode=sync", "learner.eta=4"], environ={}).learner.steps_ahead == 0
    assert load_config(None, ["learner.mode=sync", "learner.publish_every=3"], environ={}).learner.steps_ahead == 2
    with pytest.raises(ConfigError, match=r"learner.eta \(1\) must be at least learner.publish_every - 1 \(2\)"):
        load_config(None, ["learner.eta=1", "learner.publish_every=3"], environ={})
    with pytest.raises(ConfigError, match=r"learner.max_staleness \(1\) must be at least learner.publish_every - 1"):
        load_config(None, ["learner.mode=sync", "learner.max_staleness=1", "learner.publish_every=4"], environ={})
    with pytest.raises(ConfigError, match="learner.mode"):
        load_config(None, ["learner.mode=lockstep"], environ={})


def test_processes_pin_themselves_to_the_cores_their_config_names():
    import os
    import subprocess
    import sys

    code = "import os; from common.cli import pin_cpus; pin_cpus({cpus}, 'learner.cpus'); print(sorted(os.sched_getaffinity(0)))"
    first = min(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, "-c", code.format(cpus=[first])], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"[{first}]", done.stderr
    done = subprocess.run([sys.executable, "-c", code.format(cpus=[4096])], capture_output=True, text=True)
    assert done.returncode == 2 and "learner.cpus = [4096]: this process may run on CPUs" in done.stderr
    assert load_config(None, ["learner.cpus=[0]", "actor.cpus=[1, 2]"], environ={}).actor.cpus == [1, 2]
