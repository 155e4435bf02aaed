"""Peak memory of `loongforge convert` on a generated >= 2 GB checkpoint: `python scripts/bench_convert_rss.py`.

1. Writes a random bf16 Qwen2.5-VL HF checkpoint (Qwen2.5-1.5B-like language model, 8 vision blocks,
   full vocabulary, untied: ~2.4 GB in 1 GB shards) under --workdir, streaming, so generating it needs
   little memory either.
2. Runs `/usr/bin/time -v loongforge convert` HF -> mcore and mcore -> HF (with --verify in a
   separate, also measured run), plus a baseline process that only imports the same modules.
3. Prints a markdown table (checkpoint size, largest tensor, peak RSS per run) for
   docs/benchmarks/convert.md and checks the round trip is bit-exact.

Needs GNU time (`apt-get install time`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from loongforge.config.schema import LanguageConfig, ModelConfig, ProjectorConfig, VisionConfig, WindowAttentionConfig
from loongforge.convert import families
from loongforge.convert.hf_io import (
    PlannedTensor,
    SafetensorsStreamWriter,
    plan_shards,
    shard_names,
    write_index,
)


def bench_model(num_layers: int = 12) -> ModelConfig:
    return ModelConfig(
        vision=VisionConfig(depth=8, window=WindowAttentionConfig(fullatt_block_indexes=[3, 7])),
        projector=ProjectorConfig(out_hidden_size=1536),
        language=LanguageConfig(num_layers=num_layers, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                                num_query_groups=2, vocab_size=151936, tie_word_embeddings=False),
    )


def generate(folder: Path, model_cfg: ModelConfig, shard_bytes: int = 10**9) -> int:
    shapes = families.expected_hf_shapes(model_cfg)
    planned = [PlannedTensor(k, torch.bfloat16, s) for k, s in shapes.items()]
    shards = plan_shards(planned, shard_bytes)
    names = shard_names(len(shards))
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for shard, name in zip(shards, names):
        writer = SafetensorsStreamWriter(folder / name, shard)
        for t in shard:
            writer.write(t.key, (0.02 * torch.randn(t.shape, generator=generator)).to(torch.bfloat16))
        writer.close()
    write_index(folder, shards, names)
    config = families.hf_config_from_model(model_cfg, "bfloat16")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return sum(t.nbytes for t in planned)


def timed(cmd: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    summary = [line for line in proc.stdout.splitlines() if line.startswith("converted")]
    return {"peak_rss_bytes": rss_kb * 1024, "wall_s": time.perf_counter() - start,
            "summary": summary[-1] if summary else ""}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/loongforge_convert_bench"))
    parser.add_argument("--num-layers", type=int, default=12,
                        help="language layers: more layers, bigger checkpoint, same largest tensor")
    parser.add_argument("--keep", action="store_true", help="keep the converted HF copy")
    args = parser.parse_args()
    workdir = args.workdir / f"layers{args.num_layers}"
    hf, mcore, back = workdir / "hf", workdir / "mcore", workdir / "hf_back"
    model_cfg = bench_model(args.num_layers)
    if not hf.exists():
        generate(hf, model_cfg)
    shapes = families.expected_hf_shapes(model_cfg)
    largest_key = max(shapes, key=lambda k: torch.Size(shapes[k]).numel())
    largest = torch.Size(shapes[largest_key]).numel() * 2
    cli = [sys.executable, "-m", "loongforge.cli.app", "convert"]
    runs = {
        "baseline (imports only)": timed([sys.executable, "-c",
                                          "import loongforge.convert.engine, loongforge.cli.app"]),
        "HF -> mcore": timed([*cli, str(hf), str(mcore), "--to", "mcore", "--overwrite", "--no-progress"]),
        "mcore -> HF": timed([*cli, str(mcore), str(back), "--to", "hf", "--overwrite", "--no-progress"]),
        "HF -> mcore --verify": timed([*cli, str(hf), str(mcore), "--to", "mcore", "--overwrite", "--verify",
                                       "--no-progress"]),
        "mcore -> HF --verify": timed([*cli, str(mcore), str(back), "--to", "hf", "--overwrite", "--verify",
                                       "--no-progress"]),
    }
    exact = subprocess.run([*cli, str(hf), "--roundtrip", "--json", "--no-progress"], capture_output=True,
                           text=True)
    roundtrip = json.loads(exact.stdout.strip().splitlines()[-1])
    gib = 2**30
    print(f"checkpoint: {folder_bytes(hf) / gib:.2f} GiB HF ({len(list(hf.glob('*.safetensors')))} shards), "
          f"{folder_bytes(mcore) / gib:.2f} GiB mcore; largest tensor {largest_key} {largest / gib:.3f} GiB")
    print("| run | peak RSS (GiB) | wall (s) |\n|---|---|---|")
    for name, run in runs.items():
        print(f"| {name} | {run['peak_rss_bytes'] / gib:.2f} | {run['wall_s']:.0f} |")
    print(f"round trip (HF -> sharded torch_dist in a temp folder -> HF): {roundtrip['counts']} "
          f"exact={roundtrip['exact']}")
    for name, run in runs.items():
        if run["summary"]:
            print(f"{name}: {run['summary']}")
    if not args.keep:
        shutil.rmtree(back, ignore_errors=True)


if __name__ == "__main__":
    main()
