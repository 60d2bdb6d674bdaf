"""TorchRec's DLRM / DLRM-DCNv2 trained on tpu from Criteo-format files, across 2 processes.

What a TorchRec user runs on GPUs, with the device changed to ``tpu``: the model's ``EmbeddingBagCollection``
built on the meta device, ``DistributedModelParallel(model, device=torch.device("tpu"), sharders=[TorchRec's
EmbeddingBagCollectionSharder(fused_params=...)])`` (the planner, topology and data-parallel wrapper are
chosen for tpu by ``import torchtpu_rec``), TorchRec's ``TrainPipelineSparseDist`` (batch i+1's input
distribution overlaps batch i's compute), a ``CombinedOptimizer`` of the fused table optimizer and the dense
one, and ``torchrec.metrics`` (NE, AUC, calibration) for reporting.

The data: ``day_0`` (train) and ``day_1`` (held out) of Criteo-format files with a planted signal, written
by ``torchtpu_rec.criteo.write_criteo_days`` unless ``--data-dir`` already holds them, in the layout given by
``--layout``: ``tsv`` (the click-log text, read by TorchRec's ``CriteoIterDataPipe``), ``npy`` (TorchRec's
preprocessed layout, ``InMemoryBinaryCriteoIterDataPipe``) or ``multi_hot`` (MLPerf DLRM-DCNv2's multi-hot
layout). 26 categorical features, one table each, 13 dense features.

    python examples/dlrm.py --out runs/dlrm                       # spawns its 2 processes itself
    python examples/dlrm.py --model dlrm --layout tsv --out runs/dlrm_tsv
    torchrun --nproc-per-node 2 examples/dlrm.py                  # or under a launcher (RANK/WORLD_SIZE set)
    python -m ray_integration head start                          # then, through the local head (docs/ray.md):
    ray job submit --address http://127.0.0.1:<dashboard port> --working-dir . -- python examples/dlrm.py

torchrec_dlrm's ``dlrm_main.py`` flag names work beside ours (same meaning, same checks), so its command
lines carry over: ``--embedding_dim``, ``--num_embeddings``, ``--num_embeddings_per_feature``,
``--dense_arch_layer_sizes``, ``--over_arch_layer_sizes``, ``--interaction_type original|dcn|projection``,
``--dcn_num_layers``, ``--dcn_low_rank_dim``, ``--interaction_branch1_layer_sizes``,
``--interaction_branch2_layer_sizes``, ``--batch_size``, ``--learning_rate``, ``--limit_train_batches``,
``--limit_val_batches``, ``--in_memory_binary_criteo_path``, ``--synthetic_multi_hot_criteo_path``,
``--seed``; e.g.

    python examples/dlrm.py --embedding_dim 16 --num_embeddings_per_feature 1000,500,... (26) \
        --dense_arch_layer_sizes 64,16 --over_arch_layer_sizes 64,1 --interaction_type dcn --batch_size 256

Writes ``metrics.json`` and ``dlrm.png`` (loss and held-out AUC curves) to ``--out``; exits non-zero if the
final held-out AUC is not above ``--min-auc``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import sys
import time
import warnings

import numpy as np
import torch
import torch.multiprocessing as mp


def _int_list(text: str):
    """torchrec_dlrm's comma-separated int lists ("512,256,64")."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive comma-separated integers, got {text!r}")
    return out


# torchrec_dlrm's --interaction_type -> ours --model
_INTERACTIONS = {"original": "dlrm", "dcn": "dcn", "projection": "projection"}


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/dlrm", help="where metrics.json and dlrm.png go")
    p.add_argument("--model", default="dcn", choices=["dcn", "dlrm", "projection"],
                   help="DLRM_DCN (DCNv2), DLRM or DLRM_Projection")
    p.add_argument("--interaction_type", choices=sorted(_INTERACTIONS), default=None,
                   help="torchrec_dlrm's name for --model (original = dlrm)")
    p.add_argument("--layout", default="npy", choices=["tsv", "npy", "multi_hot"], help="Criteo file layout")
    p.add_argument("--data-dir", default=None, help="Criteo-format files (default: <out>/criteo, written if absent)")
    p.add_argument("--in_memory_binary_criteo_path", default=None,
                   help="torchrec_dlrm: TorchRec's npy layout in this directory (= --layout npy --data-dir)")
    p.add_argument("--synthetic_multi_hot_criteo_path", default=None,
                   help="torchrec_dlrm: the multi-hot layout in this directory (= --layout multi_hot --data-dir)")
    p.add_argument("--steps", "--limit_train_batches", dest="steps", type=int, default=80)
    p.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int, default=256, help="per process")
    p.add_argument("--rows", "--num_embeddings", dest="rows", type=int, default=1000,
                   help="rows per embedding table (ids are hashed into them)")
    p.add_argument("--num_embeddings_per_feature", type=_int_list, default=None,
                   help="rows of each of the 26 tables, comma-separated (overrides --rows)")
    p.add_argument("--dim", "--embedding_dim", dest="dim", type=int, default=16)
    p.add_argument("--dense_arch_layer_sizes", type=_int_list, default=None,
                   help="dense MLP sizes, the last = the embedding dim (default: 64,<dim>)")
    p.add_argument("--over_arch_layer_sizes", type=_int_list, default=None,
                   help="over MLP sizes, the last = 1 (default: 64,1)")
    p.add_argument("--dcn_num_layers", type=int, default=3)
    p.add_argument("--dcn_low_rank_dim", type=int, default=16)
    p.add_argument("--interaction_branch1_layer_sizes", type=_int_list, default=None,
                   help="projection interaction, branch 1 MLP (default: 64,<dim * 4>)")
    p.add_argument("--interaction_branch2_layer_sizes", type=_int_list, default=None,
                   help="projection interaction, branch 2 MLP (default: 64,<dim * 4>)")
    p.add_argument("--lr", "--learning_rate", dest="lr", type=float, default=0.05,
                   help="fused Adagrad lr of the tables")
    p.add_argument("--dense-lr", type=float, default=3e-3, help="Adam lr of the dense part")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", "--limit_val_batches", dest="eval_batches", type=int, default=4,
                   help="held-out batches per process per evaluation")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-auc", type=float, default=0.55,
                   help="exit non-zero if the final held-out AUC is not above this (0 for smoke runs)")
    args = p.parse_args(argv)
    _resolve(p, args)
    return args


def _resolve(p, args) -> None:
    """torchrec_dlrm's flags onto ours, with the checks dlrm_main.py makes (errors name the flag)."""
    from torchrec.datasets.criteo import CAT_FEATURE_COUNT

    if args.interaction_type is not None:
        args.model = _INTERACTIONS[args.interaction_type]
    for flag, layout in (("in_memory_binary_criteo_path", "npy"), ("synthetic_multi_hot_criteo_path", "multi_hot")):
        path = getattr(args, flag)
        if path is not None:
            if args.data_dir is not None and os.path.abspath(args.data_dir) != os.path.abspath(path):
                p.error(f"--{flag} {path} and --data-dir {args.data_dir} name different directories")
            args.data_dir, args.layout = path, layout
    for name in ("steps", "batch_size", "rows", "dim", "eval_batches", "dcn_num_layers", "dcn_low_rank_dim"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.num_embeddings_per_feature is not None:
        if len(args.num_embeddings_per_feature) != CAT_FEATURE_COUNT:
            p.error(f"--num_embeddings_per_feature: {len(args.num_embeddings_per_feature)} values, the Criteo "
                    f"data has {CAT_FEATURE_COUNT} categorical features")
        args.table_rows = list(args.num_embeddings_per_feature)
    else:
        args.table_rows = [args.rows] * CAT_FEATURE_COUNT
    args.dense_arch_layer_sizes = args.dense_arch_layer_sizes or [64, args.dim]
    args.over_arch_layer_sizes = args.over_arch_layer_sizes or [64, 1]
    if args.dense_arch_layer_sizes[-1] != args.dim:
        p.error(f"--dense_arch_layer_sizes {args.dense_arch_layer_sizes}: the last size must equal the embedding "
                f"dim {args.dim} (--embedding_dim), as DLRM's interaction requires")
    if args.over_arch_layer_sizes[-1] != 1:
        p.error(f"--over_arch_layer_sizes {args.over_arch_layer_sizes}: the last size must be 1 (the click logit)")
    args.interaction_branch1_layer_sizes = args.interaction_branch1_layer_sizes or [64, args.dim * 4]
    args.interaction_branch2_layer_sizes = args.interaction_branch2_layer_sizes or [64, args.dim * 4]
    for flag in ("interaction_branch1_layer_sizes", "interaction_branch2_layer_sizes"):
        if getattr(args, flag)[-1] % args.dim:
            p.error(f"--{flag} {getattr(args, flag)}: the last size must be a multiple of the embedding dim "
                    f"{args.dim} (DLRM_Projection's rule)")


def _metric_module(batch_size, world, rank):
    """TorchRec's RecMetricModule with NE, AUC and calibration of the one task (click)."""
    from torchrec.metrics.metric_module import RecMetricModule, generate_metric_module
    from torchrec.metrics.metrics_config import MetricsConfig, RecMetricDef, RecMetricEnum, RecTaskInfo

    task = RecTaskInfo(name="click", label_name="label", prediction_name="prediction", weight_name="weight")
    config = MetricsConfig(rec_tasks=[task], throughput_metric=None, state_metrics=[],
                           rec_metrics={m: RecMetricDef(rec_task_indices=[0], window_size=1 << 20)
                                        for m in (RecMetricEnum.NE, RecMetricEnum.AUC, RecMetricEnum.CALIBRATION)})
    return generate_metric_module(RecMetricModule, config, batch_size=batch_size, world_size=world, my_rank=rank,
                                  state_metrics_mapping={}, device=torch.device("tpu"))


def _model_outputs(logits, labels):
    labels = labels.float()
    return {"prediction": torch.sigmoid(logits.detach()), "label": labels, "weight": torch.ones_like(labels)}


def _summary(metrics) -> dict:
    """``{"ne", "auc", "calibration"}`` of a computed RecMetricModule (window values over all ranks; as on
    GPU, only rank 0 receives them: NaN elsewhere)."""
    pick = {"ne": "ne-click|window_ne", "auc": "auc-click|window_auc", "calibration": "calibration-click|window_calibration"}
    metrics = metrics.resolve()
    return {k: float(metrics[v]) if v in metrics else float("nan") for k, v in pick.items()}


def train(rank: int, world: int, args) -> dict:
    t_start = time.time()
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    import torch.distributed as dist

    import torchtpu  # noqa: F401  (the tpu device and the "tpu" process-group backend)
    import torchtpu_rec  # noqa: F401  (teaches TorchRec's DistributedModelParallel the tpu device)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from torchtpu_rec.criteo import criteo_dataset, day_paths, write_criteo_days

    if not dist.is_initialized():
        dist.init_process_group("tpu", rank=rank, world_size=world)
    B, tpu = args.batch_size, torch.device("tpu")
    data_dir = args.data_dir or os.path.join(args.out, "criteo")
    if rank == 0 and not all(os.path.exists(p) for ps in day_paths(data_dir, [0, 1], args.layout).values() for p in ps):
        write_criteo_days(data_dir, days=2, rows_per_day=max(args.steps, args.eval_batches) * B * world,
                          num_embeddings=args.table_rows, layouts=[args.layout], seed=args.seed)
    dist.barrier()
    train_data = criteo_dataset(data_dir, [0], args.layout, B, rank, world, num_embeddings=args.table_rows)
    eval_batches = list(itertools.islice(iter(criteo_dataset(data_dir, [1], args.layout, B, rank, world,
                                                             num_embeddings=args.table_rows)), args.eval_batches))

    torch.manual_seed(args.seed)
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=args.dim, num_embeddings=n, feature_names=[f])
              for f, n in zip(DEFAULT_CAT_NAMES, args.table_rows)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    arch = dict(dense_in_features=INT_FEATURE_COUNT, dense_arch_layer_sizes=args.dense_arch_layer_sizes,
                over_arch_layer_sizes=args.over_arch_layer_sizes, dense_device=torch.device("meta"))
    if args.model == "dcn":
        model = DLRM_DCN(ebc, dcn_num_layers=args.dcn_num_layers, dcn_low_rank_dim=args.dcn_low_rank_dim, **arch)
    elif args.model == "projection":
        model = DLRM_Projection(ebc, interaction_branch1_layer_sizes=args.interaction_branch1_layer_sizes,
                                interaction_branch2_layer_sizes=args.interaction_branch2_layer_sizes, **arch)
    else:
        model = DLRM(ebc, **arch)
    # TorchRec's own sharder, as on GPU: on tpu it becomes torchtpu_rec's, with the same fused optimizer
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD,
                                                          "learning_rate": args.lr, "eps": 1e-8})
    dmp = DistributedModelParallel(DLRMTrain(model), device=tpu, sharders=[sharder])
    # fused: the whole dense Adam step is one tpu executable
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.Adam(params, lr=args.dense_lr, fused=True))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_opt])
    pipeline = TrainPipelineSparseDist(dmp, optimizer, tpu)
    train_metrics = _metric_module(B, world, rank)

    def evaluate() -> dict:
        model_ = pipeline.detach()  # the plain model (the pipeline keeps its batch in flight)
        model_.eval()
        held_out = _metric_module(B, world, rank)
        with torch.no_grad():
            for batch in eval_batches:
                _, (_, logits, labels) = model_(batch.to(tpu))
                held_out.update(_model_outputs(logits, labels))
        model_.train()
        pipeline.attach(model_)
        return _summary(held_out.compute())

    history = {"step": [], "loss": [], "eval_step": [], "auc": [], "ne": [], "calibration": [], "train": []}

    def record_eval(step):
        res = evaluate()
        history["eval_step"].append(step)
        for k in ("auc", "ne", "calibration"):
            history[k].append(res[k])

    bar = steps_log = None
    if rank == 0:
        from step_log import StepLog
        from tqdm import tqdm

        steps_log = StepLog(args.out)  # metrics.jsonl and TensorBoard events, step by step

        bar = tqdm(total=args.steps, desc=f"{args.model} on tpu (DMP, {args.layout})", unit="step")
    setup_s = time.time() - t_start  # imports, data, process group, planner, DMP
    record_eval(0)
    t0 = time.time()
    batches = itertools.chain.from_iterable(itertools.repeat(train_data))  # epochs until --steps
    for step in range(1, args.steps + 1):
        loss, logits, labels = pipeline.progress(batches)  # the tables' Adagrad runs in the backward
        train_metrics.update(_model_outputs(logits, labels))
        lv = float(loss.item())
        history["step"].append(step)
        history["loss"].append(lv)
        if step % args.eval_every == 0 or step == args.steps:
            history["train"].append(_summary(train_metrics.compute()))
            record_eval(step)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{lv:.3f}", auc=f"{history['auc'][-1]:.3f}")
            steps_log.append(step, {"loss": lv, "held_out_auc": history["auc"][-1]})
    if bar is not None:
        bar.close()
        steps_log.close()
    wall = time.time() - t0
    plan = dmp.plan.plan
    sharding = {name: ps.sharding_type for mod in plan.values() for name, ps in mod.items()}
    # what each process of the DMP held and ran (the evidence that the tables really were sharded over 2)
    mine = {"rank": rank, "pid": os.getpid(), "device": str(next(iter(dense_opt.params.values())).device),
            "backend": dist.get_backend(), "steps": len(history["step"]),
            "tables": sorted(name for mod in plan.values() for name, ps in mod.items()
                             if ps.sharding_type != "data_parallel" and ps.sharding_spec is not None
                             and any(sh.placement.rank() == rank for sh in ps.sharding_spec.shards))}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    result = {"model": args.model, "layout": args.layout, "final_auc": history["auc"][-1],
              "initial_auc": history["auc"][0], "final_ne": history["ne"][-1],
              "final_calibration": history["calibration"][-1], "final_loss": float(np.mean(history["loss"][-10:])),
              "steps": args.steps, "batch_size_per_process": B, "world_size": world, "setup_s": setup_s,
              "wall_s": wall, "steps_per_s": args.steps / wall, "sharding": sharding, "ranks": ranks,
              "history": history}
    if rank == 0:
        _write(args.out, result)
    dist.barrier()
    dist.destroy_process_group()
    return result


def _write(out, result):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(result, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = result["history"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(h["step"], h["loss"], lw=0.8)
    a1.set_xlabel("step")
    a1.set_ylabel("train BCE loss")
    a1.set_title("loss")
    a2.plot(h["eval_step"], h["auc"], marker="o")
    a2.axhline(0.5, color="grey", ls="--", lw=0.8)
    a2.set_xlabel("step")
    a2.set_ylabel("held-out AUC (torchrec.metrics)")
    a2.set_title(f"AUC (final {result['final_auc']:.3f})")
    fig.suptitle(f"TorchRec {'DLRM-DCNv2' if result['model'] == 'dcn' else 'DLRM'} on tpu, DMP over "
                 f"{result['world_size']} processes, Criteo {result['layout']}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "dlrm.png"), dpi=100)
    print(f"final AUC {result['final_auc']:.3f} (from {result['initial_auc']:.3f}), NE {result['final_ne']:.3f}, "
          f"calibration {result['final_calibration']:.3f}; {result['steps_per_s']:.2f} steps/s; "
          f"wrote {out}/metrics.json and {out}/dlrm.png", flush=True)


def _spawned(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    train(rank, world, args)


def main(argv=None):
    args = _args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun or another launcher
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_spawned, args=(args.world_size, port, args), nprocs=args.world_size, join=True,
                       start_method="spawn")
    with open(os.path.join(args.out, "metrics.json")) as f:
        res = json.load(f)
    if res["final_auc"] <= args.min_auc:
        sys.exit(f"dlrm: AUC stayed at {res['final_auc']:.3f} (--min-auc {args.min_auc})")


if __name__ == "__main__":
    main()
