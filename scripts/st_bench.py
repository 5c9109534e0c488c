#!/usr/bin/env python3
"""The reference for `steamrf bench embed`: sentence-transformers (on torch,
CPU, default threads) encoding the same texts with the same model directory.

Reads one text per line from --texts, prints one JSON object: sentences/s
(best of --repeat runs after a warm-up), torch's thread count, and the first
--keep vectors for a parity check. With --bf16, also the same model under
torch.autocast("cpu", dtype=torch.bfloat16) (oneDNN: AMX or AVX512-BF16 where
the CPU has them): its sentences/s and the lowest cosine to the f32 vectors.
"""
import argparse, json, os, time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
from sentence_transformers import SentenceTransformer

ap = argparse.ArgumentParser()
ap.add_argument("--texts", required=True)
ap.add_argument("--model", required=True)
ap.add_argument("--batch-size", type=int, default=32)
ap.add_argument("--repeat", type=int, default=2)
ap.add_argument("--keep", type=int, default=50)
ap.add_argument("--bf16", action="store_true")
a = ap.parse_args()

with open(a.texts, encoding="utf-8") as f:
    texts = [line.rstrip("\n") for line in f]
model = SentenceTransformer(a.model, device="cpu")
model.max_seq_length = 256
model.encode(texts[:64], batch_size=a.batch_size, normalize_embeddings=True)
best = float("inf")
vecs = None
for _ in range(a.repeat):
    t = time.perf_counter()
    vecs = model.encode(texts, batch_size=a.batch_size, normalize_embeddings=True,
                        convert_to_numpy=True)
    best = min(best, time.perf_counter() - t)
report = {
    "sentences_per_s": len(texts) / best,
    "seconds": best,
    "torch": torch.__version__,
    "threads": torch.get_num_threads(),
    "vectors": vecs[: a.keep].tolist(),
}
if a.bf16:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.encode(texts[:64], batch_size=a.batch_size, normalize_embeddings=True)
        best16 = float("inf")
        for _ in range(a.repeat):
            t = time.perf_counter()
            v16 = model.encode(texts, batch_size=a.batch_size, normalize_embeddings=True,
                               convert_to_numpy=True)
            best16 = min(best16, time.perf_counter() - t)
    v16 = v16.astype("float32")
    v16 /= (v16 * v16).sum(axis=1, keepdims=True) ** 0.5
    report["bf16_sentences_per_s"] = len(texts) / best16
    report["bf16_cos_min"] = float((v16 * vecs).sum(axis=1).min())
print(json.dumps(report))
