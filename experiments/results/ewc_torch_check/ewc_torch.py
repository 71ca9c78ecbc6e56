"""Independent PyTorch check of the authors' EWC-Memory loop on Split MNIST.

The loop is the one docs/reference_code.md#ewc describes (TrentBrick/SDMContinualLearner,
models/CL_Benchmarks.py, "EWC-MEMORY"); see README.md beside this file.

    python experiments/results/ewc_torch_check/ewc_torch.py 200 0.005 10 0   # lambda beta epochs/task seed
    python experiments/results/ewc_torch_check/ewc_torch.py 200 0.005 10 0 --data_dir=DIR

--data_dir: a folder with the four MNIST IDX .gz files (default: the copy shipped in sdm_jax/data/mnist).
"""
import argparse, os, pathlib, time, gzip, numpy as np, torch, torch.nn as nn, torch.nn.functional as F
REPO_MNIST = pathlib.Path(__file__).resolve().parents[3] / "sdm_jax" / "data" / "mnist"
parser = argparse.ArgumentParser(description="PyTorch EWC-Memory on class-incremental Split MNIST.")
parser.add_argument("lam", type=float, help="lambda, the penalty's strength")
parser.add_argument("beta", type=float, help="beta of the tempered softmax in the Fisher estimate")
parser.add_argument("epochs", type=int, help="epochs per task")
parser.add_argument("seed", type=int)
parser.add_argument("--data_dir", default=str(REPO_MNIST),
                    help="folder with the MNIST IDX .gz files (default: the repository's sdm_jax/data/mnist)")
args = parser.parse_args()
torch.set_num_threads(2)
def idx(path):
    raw = gzip.open(path).read(); nd = raw[3]
    dims = [int.from_bytes(raw[4+4*i:8+4*i], "big") for i in range(nd)]
    return np.frombuffer(raw, np.uint8, offset=4+4*nd).reshape(dims)
d = args.data_dir
f = lambda name: os.path.join(d, name)
xtr = torch.tensor(idx(f("train-images-idx3-ubyte.gz")).reshape(-1, 784) / 255., dtype=torch.float32)
ytr = torch.tensor(idx(f("train-labels-idx1-ubyte.gz")).astype(np.int64))
xte = torch.tensor(idx(f("t10k-images-idx3-ubyte.gz")).reshape(-1, 784) / 255., dtype=torch.float32)
yte = torch.tensor(idx(f("t10k-labels-idx1-ubyte.gz")).astype(np.int64))
lam, beta, epochs, seed = args.lam, args.beta, args.epochs, args.seed
torch.manual_seed(seed)
model = nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
slots = []
t0 = time.time()
for task in range(5):
    m = (ytr == 2*task) | (ytr == 2*task+1)
    x, y = xtr[m], ytr[m]
    if task > 0:  # Fisher on the just-finished task
        pm = (ytr == 2*task-2) | (ytr == 2*task-1)
        px = xtr[pm]
        perm = torch.randperm(len(px))
        omega = [torch.zeros_like(p) for p in model.parameters()]
        for b in range(6):
            xb = px[perm[b*512:(b+1)*512]]
            model.zero_grad()
            out = model(xb)
            lab = out.argmax(1)
            loss = F.nll_loss(F.log_softmax(beta*out, 1), lab, reduction="sum")
            loss.backward()
            for o, p in zip(omega, model.parameters()):
                o += p.grad**2 / 2560
        slots.append(([p.detach().clone() for p in model.parameters()], omega))
        print("task", task, "omega means", [f"{o.mean().item():.2e}" for o in omega], flush=True)
    for ep in range(epochs):
        perm = torch.randperm(len(x))
        for b in range(0, len(x), 128):
            i = perm[b:b+128]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[i]), y[i])
            for anchor, omega in slots:
                loss = loss + lam*sum((o*(p-a)**2).sum() for p, a, o in zip(model.parameters(), anchor, omega))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float()
        per = [acc[(yte == 2*t) | (yte == 2*t+1)].mean().item() for t in range(5)]
    print(f"after task {task}: full {acc.mean().item():.4f} per-task {[round(a,3) for a in per]} ({time.time()-t0:.0f}s)", flush=True)
