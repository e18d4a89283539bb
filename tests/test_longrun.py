"""Long runs (issue 21): WSD decay branches, resumable jobs, per-position records, the
planner, rank stability and Holm-adjusted comparisons."""
import json
import math
import time

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import forked, hold_lock, random_sequences, tiny_model, wait_for_lock_record
from scipy import stats as scipy_stats

from actwave.config import cpu_name
from actwave.decoding.acceptance import SequenceAcceptance, tau_hat
from actwave.eagle3 import train as train_mod
from actwave.eagle3.online import OnlineSource, train_online
from actwave.eagle3.schedule import WSDSchedule, cost, wsd_factor
from actwave.eagle3.train import Segment
from actwave.integrity import WriterLock, is_held
from actwave.study import keysets, longdecode, longrun, longscore, longtext
from actwave.study import report as study_report
from actwave.study import stats as study_stats
from actwave.study.runs import StudySet

SETS = [StudySet("eagle3_default", (1, 2, 3), "default", 1),
        StudySet("renyi2_exhaustive@filtered", (2, 3, 4), "selected", 1)]


def _config(**changes):
    """Budgets 2 / 4 / 8 steps: decays 1 / 1 / 2, branch points 1 / 3 / 6."""
    values = dict(model="tiny", base_steps=2, multipliers=(1, 2, 4), decay_fraction=0.25,
                  min_decay=1, warmup_steps=1, max_seq_len=32, ttt_steps=2,
                  draft_vocab_size=64, checkpoint_every=2, eval_batch_size=3)
    return longrun.LongRunConfig(**{**values, **changes})


@torch.no_grad()
def _greedy_source(target, n=5, prompt=4, new=14) -> OnlineSource:
    """Sequences whose replies are the target's own greedy continuation (as the pools)."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 128, (1, prompt), generator=generator)
        for _ in range(new):
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
        rows.append({"input_ids": ids[0].tolist(), "loss_mask": [p >= prompt for p in
                                                                 range(prompt + new)]})
    return OnlineSource.from_sequences(rows, "online-eval", "eval")


def _run(tmp_path, target, config=None) -> longrun.LongRun:
    train = OnlineSource.from_sequences(random_sequences(8, 0), "online-train", "train")
    return longrun.open_run(config or _config(), target, train, _greedy_source(target), SETS,
                            tmp_path / "results", tmp_path / "work", progress=False)


# ----------------------------------------------------------------------------- schedule
def test_wsd_factor_warms_up_holds_and_decays_to_zero_at_the_branch_end():
    schedule = WSDSchedule(warmup_steps=4, budgets=(64, 256), decay_fraction=0.2, min_decay=16)
    trunk, branch = schedule.trunk(), schedule.branch(256)
    assert [trunk(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert all(trunk(s) == 1.0 for s in range(4, 100_000))  # the trunk never decays
    assert schedule.decay_steps(64) == 16 and schedule.decay_steps(256) == 52
    start = schedule.branch_start(256)
    assert start == 204 and all(branch(s) == trunk(s) for s in range(start + 1))
    decay = [branch(s) for s in range(start, 257)]
    assert decay[-2] == pytest.approx(1 / 52) and decay[-1] == 0.0
    assert np.allclose(np.diff(decay), -1 / 52)
    assert wsd_factor(300, 4, start, 256) == 0.0
    with pytest.raises(ValueError, match="before step"):
        WSDSchedule(warmup_steps=10, budgets=(12,), decay_fraction=0.2, min_decay=4)


def test_cost_counts_trunk_and_decays_against_separate_runs():
    schedule = longrun.LongRunConfig(model="smollm2-135m").schedule()
    assert schedule.budgets == (64, 256, 1024, 2048)
    assert cost(schedule) == {"trunk": 1638, "branches": 683, "wsd": 2321, "separate": 3392}


# ----------------------------------------------------------------------------- training
def test_branch_from_trunk_checkpoint_equals_straight_run(tmp_path):
    target = tiny_model("llama")
    source = OnlineSource.from_sequences(random_sequences(8, 0), "online-train", "train")
    schedule = WSDSchedule(warmup_steps=1, budgets=(4, 8), decay_fraction=0.25, min_decay=1)
    config = _config().train_config((1, 2, 3), seed=0, total_steps=8)
    start = schedule.branch_start(8)  # 6, between two checkpoint_every=4 checkpoints
    config = train_mod.TrainConfig(**{**config.__dict__, "checkpoint_every": 4})
    trunk = train_online(source, target, config, tmp_path / "trunk", progress=False,
                         segment=Segment(schedule.trunk(), stop_at=start))
    assert len(trunk.history) == start and not (tmp_path / "trunk" / "config.json").exists()
    assert [row["lr"] for row in trunk.history[1:]] == [config.lr] * (start - 1)
    branch = train_online(source, target, config, tmp_path / "branch", progress=False,
                          segment=Segment(schedule.branch(8),
                                          init_from=tmp_path / "trunk" / "checkpoints"
                                          / f"step-{start:07d}"))
    straight = train_online(source, target, config, tmp_path / "straight", progress=False,
                            segment=Segment(schedule.branch(8)))
    assert [r["loss"] for r in branch.history] == [r["loss"] for r in straight.history]
    assert [r["lr"] for r in branch.history] == [r["lr"] for r in straight.history]
    assert branch.history[-1]["lr"] == pytest.approx(config.lr / 2)  # d = 2: 1/2, then 0
    for name, tensor in straight.draft.trainable_state_dict().items():
        assert torch.equal(branch.draft.trainable_state_dict()[name], tensor), name
    other = OnlineSource.from_sequences(random_sequences(8, 1), "online-other", "other")
    with pytest.raises(ValueError, match="trained on online-train"):
        train_online(other, target, config, tmp_path / "other", progress=False,
                     segment=Segment(schedule.branch(8), init_from=tmp_path / "trunk"
                                     / "checkpoints" / f"step-{start:07d}"))
    with pytest.raises(ValueError, match="must lie between the start step 6"):  # the trunk cannot go back to step 3
        train_online(source, target, config, tmp_path / "trunk", progress=False,
                     segment=Segment(schedule.trunk(), stop_at=3))


def _stable(record: dict) -> dict:
    """A record without what depends on the clock or the machine."""
    return {k: v for k, v in record.items() if k not in ("training", "machine", "versions")}


def test_interrupted_run_resumes_to_identical_records(tmp_path, monkeypatch):
    target = tiny_model("llama")
    config = _config()
    jobs = longrun.plan(SETS, config.budgets)
    straight = longrun.run_jobs(jobs, _run(tmp_path / "straight", target), progress=False)
    original = train_mod.history_row
    for crash_at in (5, 8):  # inside the first trunk's last segment, then inside its branch
        def crash(step, *args):
            if step == crash_at:
                raise KeyboardInterrupt("simulated crash")
            return original(step, *args)
        monkeypatch.setattr(train_mod, "history_row", crash)
        with pytest.raises(KeyboardInterrupt):
            longrun.run_jobs(jobs, _run(tmp_path / "resumed", target), progress=False)
    monkeypatch.setattr(train_mod, "history_row", original)
    resumed = longrun.run_jobs(jobs, _run(tmp_path / "resumed", target), progress=False)
    assert [_stable(r) for r in resumed] == [_stable(r) for r in straight]
    for record, job in zip(resumed, jobs):
        assert record["training"]["steps"] == job.budget == record["budget"]
        path = longrun.record_path(tmp_path / "resumed" / "results", job)
        assert path.name == f"{job.label}-s0-b{job.budget}.json" and path.stat().st_size < 200_000
    assert not list((tmp_path / "resumed" / "work").rglob("branch-points/step-*"))
    report = longrun.status(jobs, tmp_path / "resumed" / "results", config.schedule())
    assert report["missing"] == [] and report["remaining_seconds"] == 0


def test_records_per_position_acceptance_reproduces_tau_and_walks(tmp_path):
    target = tiny_model("llama")
    run = _run(tmp_path, target)
    record = longrun.run_job(longrun.plan(SETS, run.config.budgets)[0], run)
    offline = record["offline"]
    decoded = longscore.decode_positions(offline["positions"])
    assert len(decoded) == offline["n_sequences"] == len(run.eval)
    accepted = sum(int(a.sum()) for _, a in decoded)
    roots = sum(r.size for r, _ in decoded)
    assert roots == offline["n_roots"] and 1.0 + accepted / roots == offline["tau_hat"]
    for (r, a), row in zip(decoded, offline["per_sequence"]):
        assert (int(a.sum()), r.size) == (row["accepted"], row["roots"])
        tau, rounds = longscore.sequence_walk(r, a, row["n_reply"])
        assert rounds == row["walk_rounds"] and tau == pytest.approx(row["walk_tau"], abs=0)
    assert len(offline["step_acceptance"]) == len(offline["step_agreement"]) == 2
    assert record["data"]["eval"] == "online-eval" and record["schedule"]["branch_start"] == 1
    assert record["machine"]["cpu"] == cpu_name() != ""  # costs are grouped by it
    assert record["data"]["eval_features"] == run.eval.digest
    draft = longdecode.branch_draft(record, target, run.work_dir)  # what item 5 decodes
    assert draft.fingerprint() == record["draft_fingerprint"]
    with pytest.raises(ValueError, match="the record scored"):
        longdecode.branch_draft({**record, "draft_fingerprint": "0" * 16}, target, run.work_dir)
    with pytest.raises(FileNotFoundError, match="no draft of record"):
        longdecode.branch_draft(record, target, tmp_path / "elsewhere")


def test_drafts_are_due_for_decoding_where_they_are_until_decoded(tmp_path):
    """A draft is decoded on the machine that holds it (a fresh clone holds the record, not
    the draft: nothing is due), once (its run's tables mark it done); the gathered tables
    are those of the current records' runs."""
    work, results = tmp_path / "work", tmp_path / "results"
    record = {"label": "a", "seed": 1, "budget": 8, "key": "k1"}
    other_seed, elsewhere = {**record, "seed": 2}, {**record, "label": "b"}
    for held in (record, other_seed):
        folder = longdecode.branch_draft_dir(held, work)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    records = [record, other_seed, elsewhere]
    assert longdecode.due(records, 8, 1, results, work) == [record]
    assert longdecode.due(records, 4, 1, results, work) == []
    assert longdecode.decoded_tables(results, records, ["a", "b"], 8, 1) is None
    run = longdecode.run_dir(results, record)
    run.mkdir(parents=True)
    for name, value in (("summary", 1.2), ("walk", True)):
        pd.DataFrame({"label": ["a"], "value": [value]}).to_csv(run / f"{name}.csv", index=False)
    assert longdecode.due(records, 8, 1, results, work) == []
    tables = longdecode.decoded_tables(results, records, ["a", "b"], 8, 1)
    assert tables["summary"]["value"].tolist() == [1.2] and tables["walk"]["value"].tolist() == [True]
    retrained = {**record, "key": "k2"}  # a new record key: its old run is not its tables
    assert longdecode.decoded_tables(results, [retrained], ["a"], 8, 1) is None
    assert longdecode.due([retrained], 8, 1, results, work) == []  # its draft is not here


def test_positions_round_trip_and_walk_matches_decode_walk():
    generator = torch.Generator().manual_seed(0)
    results = []
    for first, length in ((5, 40), (3, 17), (9, 1)):
        accepted = torch.randint(0, 4, (length,), generator=generator)
        results.append(SequenceAcceptance(accepted, torch.zeros(3), torch.arange(first,
                                                                                 first + length)))
    gap = SequenceAcceptance(torch.tensor([1, 0, 2]), torch.zeros(3), torch.tensor([4, 5, 9]))
    encoded = longscore.encode_positions(results + [gap])
    assert encoded["roots"][-1] == [[4, 2], [9, 1]]
    decoded = longscore.decode_positions(json.loads(json.dumps(encoded)))
    for (roots, accepted), result in zip(decoded, results + [gap]):
        assert roots.tolist() == result.roots.tolist()
        assert accepted.tolist() == result.accepted.tolist()
    assert 1.0 + sum(a.sum() for _, a in decoded) / sum(r.size for r, _ in decoded) == \
        tau_hat(results + [gap])
    # a reply of n tokens has n − 1 roots; the walk jumps accepted + 1 tokens per round
    tau, rounds = longscore.sequence_walk([5, 6, 7, 8], [2, 0, 0, 1], 5)
    assert (tau, rounds) == (4 / 2, 2)
    assert math.isnan(longscore.sequence_walk([4, 5, 9], [1, 0, 2], 4)[0])


# ----------------------------------------------------------------------------- planner
def test_deadline_stops_new_jobs_but_keeps_finished_records(tmp_path):
    target = tiny_model("llama")
    config = _config()
    jobs = longrun.plan(SETS, config.budgets)
    run = _run(tmp_path, target)
    trained = []  # the after-job hook (the worker decodes there) sees jobs it trained only
    first = longrun.run_jobs(jobs, run, max_jobs=1, progress=False, after=trained.append)
    assert len(first) == 1 and trained == first
    passed = longrun.run_jobs(jobs, run, progress=False, deadline=time.monotonic() - 1,
                              after=trained.append)
    assert [r["key"] for r in passed] == [r["key"] for r in first]  # read, none started
    assert trained == first
    assert not longrun.record_path(run.results_dir, jobs[1]).exists()


def test_workers_skip_a_trunk_another_process_holds(tmp_path):
    """Two workers on one job list: a job whose (set, seed) trunk a live process has claimed
    is skipped, not trained twice; once that process is gone, a rerun takes it."""
    target = tiny_model("llama")
    config = _config()
    jobs = longrun.plan(SETS, config.budgets)
    run = _run(tmp_path, target)
    held = [j for j in jobs if j.label == "eagle3_default"]
    lock = longrun.claim(run, held[0]).path
    holder = forked(hold_lock, lock.parent, 120.0)
    try:
        wait_for_lock_record(lock)
        records = longrun.run_jobs(jobs, run, progress=False)
    finally:
        holder.kill()
        holder.join()
    assert {r["label"] for r in records} == {"renyi2_exhaustive@filtered"}
    assert not any(longrun.record_path(run.results_dir, j).exists() for j in held)
    rerun = longrun.run_jobs(jobs, run, progress=False)
    assert [r["budget"] for r in rerun if r["label"] == "eagle3_default"] == \
        [j.budget for j in held]


def test_plan_finishes_whole_budgets_first_and_status_estimates(tmp_path):
    sets = [StudySet("zeta", (1, 2), "random", 1), StudySet(study_stats.PRIMARY, (2, 3), "s", 3),
            StudySet(study_stats.REFERENCE, (1, 3), "default", 3)]
    schedule = WSDSchedule(warmup_steps=6, budgets=(64, 256, 1024))
    jobs = longrun.plan(sets, schedule.budgets)
    assert [j.name for j in jobs[:4]] == [f"{study_stats.REFERENCE}-s0-b64",
                                          f"{study_stats.PRIMARY}-s0-b64", "zeta-s0-b64",
                                          f"{study_stats.REFERENCE}-s1-b64"]
    assert len(jobs) == 3 * 7
    first_big = min(i for i, j in enumerate(jobs) if j.budget == 1024)
    assert all(i < first_big for i, j in enumerate(jobs) if j.budget < 1024)
    whole = longrun.plan(sets, schedule.budgets, whole_budgets=1)  # above 64: trunk by trunk
    assert [j.name for j in whole[7:10]] == [f"{study_stats.REFERENCE}-s0-b256",
                                             f"{study_stats.REFERENCE}-s0-b1024",
                                             f"{study_stats.PRIMARY}-s0-b256"]
    steps = longrun.job_steps(jobs, schedule)
    trunk = [steps[j] for j in jobs if (j.label, j.seed) == ("zeta", 0)]
    assert sum(trunk) == schedule.trunk_steps + sum(schedule.decay_steps(b)
                                                   for b in schedule.budgets)
    assert trunk[0] == 64
    done = jobs[:5]
    for job in done:
        path = longrun.record_path(tmp_path, job)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"budget": job.budget, "training": {
            "seconds": 2.0 * job.budget, "score_seconds": 10.0}}))
    report = longrun.status(jobs, tmp_path, schedule)
    assert report["done"] == [j.name for j in done] and report["missing"][0] == jobs[5].name
    assert report["by_budget"] == {64: [5, 7], 256: [0, 7], 1024: [0, 7]}
    assert report["seconds_per_step"] == 2.0 and report["score_seconds"] == 10.0
    assert report["remaining_seconds"] == sum(2.0 * steps[j] + 10.0 for j in jobs[5:])
    here = longrun.record_path(tmp_path, jobs[0])  # one record made on this CPU model
    here.write_text(json.dumps({"budget": 64, "machine": {"cpu": cpu_name()}, "training": {
        "seconds": 64.0, "score_seconds": 4.0}}))
    report = longrun.status(jobs, tmp_path, schedule)
    assert report["seconds_per_step"] == 1.0 and report["score_seconds"] == 4.0


def test_command_runs_with_the_profiles_settings(capsys, monkeypatch):
    """`actwave longrun` builds its config from the profile notebook 12 reads (one home)."""
    seen = {}

    def sets(model, labels, seeds):
        seen.update(model=model, labels=labels, seeds=seeds)
        return [StudySet("eagle3_default", (1, 2, 3), "default", seeds)]

    monkeypatch.setattr(longrun, "study_sets", sets)
    longrun.main(["--profile", "smoke-study", "--model", "smollm2-135m", "--status"])
    assert seen == {"model": "smollm2-135m", "labels": ["eagle3_default"], "seeds": 1}
    out = capsys.readouterr().out
    assert "budgets (2, 4):" in out and "2 jobs" in out and "done 0/2" in out
    with pytest.raises(SystemExit):
        longrun.main(["--profile", "smoke", "--status"])
    assert "profile 'smoke' lacks ['longrun_sets'" in capsys.readouterr().err


def test_committed_records_keep_their_keys(smollm2):
    """Every committed SmolLM2 long-run record is found by a fresh clone: the profile's
    config, the record's layers and seed, and the values digests of the pinned pools'
    features (``features.values_digest``: text, target weights, dtypes, not the float bits
    a CPU computes) give exactly its key, so nothing retrains (11-13 h of CPU)."""
    from actwave.eagle3.features import values_digest
    from actwave.profile import build, parameters
    from actwave.tools.runplan import load_profile

    values = parameters(load_profile("study"))
    config = build("longrun", values, model="smollm2-135m")
    target, tokenizer = smollm2
    sources = longtext.text_sources("smollm2-135m", tokenizer, config.max_seq_len,
                                   values["longrun_train_conversations"],
                                   values["longrun_eval_conversations"])
    records = longrun.load_records(longrun.results_folder("smollm2-135m"))
    assert len(records) == 72
    digests = [values_digest(sources[split], target, feature) for split, feature in zip(
        ("train", "eval"), longrun.feature_configs(config, [0]))]  # the same for any layers
    for record in records:
        job = longrun.Job(record["label"], tuple(record["layer_ids"]), record["seed"],
                          record["budget"])
        assert longrun.job_key(config, job, *digests) == record["key"], job.name


def test_study_sets_pin_the_pre_registration(tmp_path, monkeypatch):
    """The first call chooses the key sets from the 1× study and pins them beside the
    long-run records; a rerun of the 1× study that would choose others (new layer
    statistics, new τ̂) does not move them."""
    from actwave.study import runs

    table = tmp_path / "08_sets_smollm2-135m.csv"

    def one_x_study(compartments: str, taus: dict):
        table.write_text(
            'label,layer_ids,kind,seeds,aliases\neagle3_default,"2,15,27",default,3,\n'
            'renyi2_exhaustive@filtered,"11,28,29",selected,3,\n'
            'renyi2_exhaustive,"2,28,29",selected,3,\n'
            f'cka_compartments,"{compartments}",selected,1,\n'
            'random_low_1,"1,6,10",random,1,\nrandom_high_1,"17,19,21",random,1,\n'
            'last_k,"28,29,30",baseline,1,\n')
        monkeypatch.setattr(runs, "load_records", lambda folder: [
            {"label": label, "steps_factor": 1, "offline": {"tau_hat": tau}}
            for label, tau in taus.items()])

    one_x_study("10,20,27", {"cka_compartments": 1.17, "random_low_1": 1.10,
                             "random_high_1": 1.16})
    first = longrun.study_sets("smollm2-135m", None, 3, tmp_path)
    pinned = longrun.results_folder("smollm2-135m", tmp_path) / keysets.SETS_FILE
    assert pinned.is_file()
    assert [s.label for s in first][3:5] == ["cka_compartments", "random_high_1"]
    rerun_taus = {"cka_compartments": 1.17, "random_low_1": 1.20, "random_high_1": 1.16}
    one_x_study("2,10,27", rerun_taus)
    assert keysets.key_sets(keysets.read_sets(table), rerun_taus, 3) != first
    again = longrun.study_sets("smollm2-135m", None, 2, tmp_path)
    assert [(s.label, s.layer_ids, s.kind) for s in again] == [
        (s.label, s.layer_ids, s.kind) for s in first]
    assert {s.seeds for s in again} == {2}
    pinned.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a long-run set file"):
        longrun.study_sets("smollm2-135m", None, 3, tmp_path)


def test_committed_long_runs_ran_their_pinned_sets():
    """Both models' key sets are pinned (pre-registered in the README before any long run),
    and every committed record is one of them: what a resumed run reads."""
    root = longrun.results_folder("smollm2-135m").parent
    folders = sorted(path.parent for path in root.glob(f"*/{keysets.SETS_FILE}"))
    assert [f.name for f in folders] == ["gemma3-270m", "smollm2-135m"]
    assert {path.parent.parent for path in root.glob("*/records/*.json")} <= set(folders)
    for folder in folders:
        sets = keysets.pinned_sets(folder / keysets.SETS_FILE, seeds=3)
        assert len(sets) == 6, folder.name
        allowed = {(s.label, s.layer_ids) for s in sets}
        for record in longrun.load_records(folder):
            assert (record["label"], tuple(record["layer_ids"])) in allowed, record["label"]


def test_read_sets_takes_the_table_or_given_seeds(tmp_path):
    path = tmp_path / "sets.csv"
    path.write_text('label,layer_ids,kind,seeds\neagle3_default,"2,15,27",default,3\n'
                    'top_layer,30,baseline,1\n')
    sets = keysets.read_sets(path)
    assert [(s.label, s.layer_ids, s.seeds) for s in sets] == [
        ("eagle3_default", (2, 15, 27), 3), ("top_layer", (30,), 1)]
    assert [s.seeds for s in keysets.read_sets(path, ["top_layer"], seeds=2)] == [2]
    with pytest.raises(ValueError, match="no set"):
        keysets.read_sets(path, ["missing"])


# ----------------------------------------------------------------------------- statistics
def _record(label, seed, budget, accepted, roots=(10, 10, 10, 10)):
    return {"label": label, "seed": seed, "budget": budget, "layer_ids": [1], "kind": "x",
            "training": {"tokens": 100 * budget},
            "offline": {"per_sequence": [{"accepted": a, "roots": r}
                                         for a, r in zip(accepted, roots)],
                        "step_agreement": [0.5, 0.4], "step_acceptance": [0.5, 0.25]}}


def test_step_table_splits_chained_acceptance_into_conditional_steps():
    records = [_record("a", seed, 64, [1]) for seed in (0, 1)]
    records[1]["offline"].update(step_agreement=[0.3, 0.2], step_acceptance=[0.3, 0.03])
    table = study_report.step_table(records).set_index("step")
    assert table["agreement"].tolist() == pytest.approx([0.4, 0.3])  # seed means
    assert table["chained"].tolist() == pytest.approx([0.4, 0.14])
    assert table["conditional"].tolist() == pytest.approx([0.4, (0.5 + 0.1) / 2])
    assert table["independent"].tolist() == pytest.approx([0.4, (0.2 + 0.06) / 2])


def test_committed_chained_acceptance_equals_the_per_position_lengths():
    """Two routes to c_i: the scorer's stored step acceptance, and the share of held-out roots
    whose stored accepted-chain length is > i."""
    path = sorted(longrun.results_folder("smollm2-135m").glob("records/*.json"))[0]
    offline = json.loads(path.read_text())["offline"]
    lengths = np.concatenate([accepted for _, accepted in
                              longscore.decode_positions(offline["positions"])])
    assert lengths.size == offline["n_roots"]
    shares = [(lengths > step).mean() for step in range(offline["depth"])]
    assert shares == pytest.approx(offline["step_acceptance"], abs=1e-6)


def test_rank_stability_matches_scipy():
    taus = {64: [0.1, 0.5, 0.3, 0.9, 0.7], 256: [0.2, 0.4, 0.6, 0.8, 0.5],
            1024: [0.9, 0.1, 0.5, 0.3, 0.7]}
    records = [_record(f"set{i}", 0, budget, [round(40 * t)] * 4)
               for budget, values in taus.items() for i, t in enumerate(values)]
    rows = study_stats.rank_stability(records, n_permutations=500)
    assert [(r["budget"], r["next_budget"], r["n"]) for r in rows] == [(64, 256, 5),
                                                                       (256, 1024, 5)]
    for row, (x, y) in zip(rows, [(taus[64], taus[256]), (taus[256], taus[1024])]):
        assert row["spearman"] == pytest.approx(scipy_stats.spearmanr(x, y)[0])
        assert row["kendall"] == pytest.approx(scipy_stats.kendalltau(x, y)[0])
        assert 0 < row["spearman_p"] <= 1 and 0 < row["kendall_p"] <= 1
    curves = study_stats.budget_curves(records + [_record("set0", 1, 64, [8, 8, 8, 8])])
    first = curves[0]
    assert (first["label"], first["budget"], first["n_seeds"]) == ("set0", 64, 2)
    assert first["tau_hat_min"] == 1.4 and first["tau_hat_max"] == 1.8  # τ̂ = 1 + 4t
    assert first["tau_hat"] == pytest.approx(1.6) and first["tokens"] == 6400


def test_holm_matches_hand_computation():
    # sorted 0.005, 0.01, 0.03, 0.04 -> ×4, ×3, ×2, ×1 = 0.02, 0.03, 0.06, 0.04 -> monotone
    assert study_stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert study_stats.holm([0.5, 0.4]) == [0.8, 0.8]
    adjusted = study_stats.holm([0.2, math.nan, 0.6])
    assert adjusted[0] == pytest.approx(0.4) and math.isnan(adjusted[1]) and adjusted[2] == 0.6


def test_budget_comparisons_adjust_all_but_the_primary():
    rng = np.random.default_rng(0)
    labels = [study_stats.REFERENCE, study_stats.PRIMARY, "a", "b"]
    records = [_record(label, seed, budget, rng.integers(0, 10 + 3 * i, size=6).tolist(),
                       roots=[10] * 6)
               for budget in (64, 256) for i, label in enumerate(labels) for seed in range(3)]
    rows = study_stats.budget_comparisons(records, n_bootstrap=300)
    assert [(r["budget"], r["label"]) for r in rows] == [
        (b, label) for b in (64, 256) for label in sorted(labels[1:])]
    for budget in (64, 256):
        group = [r for r in records if r["budget"] == budget]
        arms = study_stats.by_label(group)
        found = {r["label"]: r for r in rows if r["budget"] == budget}
        expected = study_stats.paired_difference(arms["a"], arms[study_stats.REFERENCE],
                                                  n_bootstrap=300)
        assert {k: found["a"][k] for k in expected} == expected
        assert found["a"]["p_level"] == "seed×sequence"
        family = [r for r in found.values() if not r["primary"]]
        assert [r["p_holm"] for r in family] == study_stats.holm([r["p"] for r in family])
    primary = [r for r in rows if r["primary"]]
    assert [(r["budget"], r["label"]) for r in primary] == [(256, study_stats.PRIMARY)]
    assert primary[0]["p_holm"] == primary[0]["p"]


def test_rank_vs_largest_says_which_budget_predicts():
    taus = {64: [0.9, 0.1, 0.5, 0.3, 0.7, 0.2], 256: [0.1, 0.2, 0.3, 0.5, 0.6, 0.8],
            1024: [0.1, 0.2, 0.3, 0.5, 0.7, 0.9]}
    records = [_record(f"set{i}", 0, budget, [round(40 * t)] * 4)
               for budget, values in taus.items() for i, t in enumerate(values)]
    rows = study_stats.rank_vs_largest(records, n_permutations=2000)
    assert [(r["budget"], r["versus"], r["n"]) for r in rows] == [(64, 1024, 6), (256, 1024, 6)]
    partial = records + [_record("set0", 0, 2048, [40] * 4)]  # a budget under way is left out
    assert study_stats.rank_vs_largest(partial, n_permutations=2000) == rows
    assert [r["next_budget"] for r in study_stats.rank_stability(partial, 200)] == [256, 1024]
    assert rows[1]["spearman"] == pytest.approx(1.0) and rows[1]["predicts"]
    assert rows[0]["spearman"] == pytest.approx(scipy_stats.spearmanr(taus[64], taus[1024])[0])
    assert not rows[0]["predicts"]
    tables = study_report.long_tables(records, n_bootstrap=50, n_permutations=200)
    stability = tables["rank_stability"]
    assert set(stability["comparison"]) == {"next budget", "largest budget"}
    everyone = stability[stability["seeds"] == "all"]
    assert everyone.loc[everyone["comparison"] == "largest budget", "train_steps"].tolist() == [64, 256]
    assert everyone.drop(columns="seeds").equals(  # every record is seed 0 here
        stability[stability["seeds"] == "0"].drop(columns="seeds").reset_index(drop=True))
    seeds_one = [dict(r, seed=1) for r in records if r["budget"] < 1024]  # seed 1 under way
    both = study_report.long_tables(records + seeds_one, n_bootstrap=50,
                                    n_permutations=200)["rank_stability"]
    largest = both[both["comparison"] == "largest budget"]
    assert set(largest.loc[largest["seeds"] == "all", "versus"]) == {256}
    assert set(largest.loc[largest["seeds"] == "0", "versus"]) == {1024}
    assert len(tables["sets"]) == 18 and {"tau_hat", "tau_hat_sd"} <= set(tables["sets"])
    figure = study_report.plot_tau_vs_budget(tables["sets"])
    assert len(figure.axes[0].lines) == 6
    for record, load in zip(records, [2.0, 3.5] * 9):
        record["training"].update(seconds=1.5 * record["budget"], score_seconds=60.0)
        record["machine"] = {"device": "cpu", "load_average": 1.9, "load_average_end": load}
    costs = study_report.long_costs(records)
    assert costs["budget"].tolist() == [64, 256, 1024] and costs["drafts"].tolist() == [6] * 3
    assert costs["idle_drafts"].tolist() == [3] * 3  # load 3.5 at the end: shared cores
    assert costs["seconds_per_step"].tolist() == pytest.approx([1.5] * 3)
    assert costs["train_seconds_idle"].tolist() == pytest.approx([96.0, 384.0, 1536.0])
    assert set(costs["cpu"]) == {"unrecorded"}
    records[0]["machine"]["cpu"] = "Some CPU"  # another machine's seconds are not pooled
    by_cpu = study_report.long_costs(records)
    assert by_cpu[["budget", "cpu", "drafts"]].values.tolist()[:2] == [
        [64, "Some CPU", 1], [64, "unrecorded", 5]]


def test_key_sets_take_labels_or_aliases_and_the_best_of_each_family():
    sets = [StudySet("eagle3_default", (2, 15, 27), "default", 3),
            StudySet("greedy", (11, 28, 29), "selected", 1, ("renyi2_exhaustive@filtered",)),
            StudySet("renyi2_exhaustive", (2, 28, 29), "selected", 1),
            StudySet("cka_compartments", (10, 20, 27), "selected", 1),
            StudySet("cka_compartments@filtered", (2, 10, 27), "selected", 1),
            StudySet("random_low_1", (1, 6, 10), "random", 1),
            StudySet("random_high_1", (17, 19, 21), "random", 1),
            StudySet("entropy_topk", (28, 29, 30), "selected", 1, ("last_k",))]
    one_x = {"cka_compartments": 1.17, "cka_compartments@filtered": 1.18,
             "random_low_1": 1.10, "random_high_1": 1.16}
    chosen = keysets.key_sets(sets, one_x, seeds=3)
    assert [(s.label, s.layer_ids) for s in chosen] == [
        ("eagle3_default", (2, 15, 27)), ("renyi2_exhaustive@filtered", (11, 28, 29)),
        ("renyi2_exhaustive", (2, 28, 29)), ("cka_compartments@filtered", (2, 10, 27)),
        ("random_high_1", (17, 19, 21)), ("last_k", (28, 29, 30))]
    assert {s.seeds for s in chosen} == {3}
    with pytest.raises(ValueError, match="no scored random set"):
        keysets.key_sets(sets, {"cka_compartments": 1.2}, seeds=3)


def test_the_worker_decodes_only_the_decoding_seed_at_the_largest_budget(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(longdecode, "decode_due", lambda *args: calls.append(args[1][0]["label"]))
    config, values = _config(), {"longrun_decode_seed": 1}
    largest = max(config.budgets)
    for label, seed, budget in (("a", 1, largest), ("b", 0, largest), ("c", 1, largest // 2)):
        record = {"label": label, "seed": seed, "budget": budget}
        longrun.decode_finished("smollm2-135m", record, values, config, tmp_path)
    assert calls == ["a"]

    def fails(*args):
        raise RuntimeError("a prompt the harness refuses")

    monkeypatch.setattr(longdecode, "decode_due", fails)  # logged; the worker trains on
    longrun.decode_finished("smollm2-135m", {"label": "a", "seed": 1, "budget": largest}, values,
                            config, tmp_path)


def test_is_held_and_live_workers_follow_the_kernel_lock(tmp_path):
    """``longrun --status`` counts workers by their claims' kernel locks: a held claim
    counts, a dead worker's leftover lock file does not, and probing takes nothing."""
    claims = tmp_path / "claims"
    assert longrun.live_workers(tmp_path) == 0  # no claims folder
    assert not is_held(claims / "a")  # no lock file
    holders = [forked(hold_lock, claims / name, 30.0) for name in ("a", "b")]
    for name in ("a", "b"):
        wait_for_lock_record(claims / name / ".lock")
    assert is_held(claims / "a") and longrun.live_workers(tmp_path) == 2
    holders[0].kill()  # dies holding it: the file stays, the kernel lock goes
    holders[0].join()
    assert (claims / "a" / ".lock").exists() and not is_held(claims / "a")
    assert longrun.live_workers(tmp_path) == 1
    with WriterLock(claims / "a", timeout=0):  # the probe left nothing behind
        assert is_held(claims / "a") and longrun.live_workers(tmp_path) == 2
    holders[1].kill()
    holders[1].join()
    assert longrun.live_workers(tmp_path) == 0
