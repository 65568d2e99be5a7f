"""A training script written the way Lightning Fabric's own examples are (classifier, k-fold, GAN), with only the
import changed: ``from fabric import Fabric``. It never calls ``fabric.launch()``, as those examples don't.

    python lightning_style.py OUTDIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from fabric import Fabric, seed_everything


def make_data(n: int = 256) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=generator)
    y = (x[:, :4].sum(dim=1) > 0).long()
    return TensorDataset(x, y)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.net(x), dim=1)


def classifier(fabric: Fabric, epochs: int, out: Path) -> dict:
    dataset = make_data()
    train_loader = DataLoader(torch.utils.data.Subset(dataset, range(192)), batch_size=32, shuffle=True)
    test_loader = DataLoader(torch.utils.data.Subset(dataset, range(192, 256)), batch_size=32)
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)
    model = Classifier()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for epoch in range(epochs):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            fabric.backward(loss)
            optimizer.step()
        losses.append(loss.item())
        scheduler.step()
        model.eval()
        test_loss, correct = torch.tensor(0.0, device=fabric.device), torch.tensor(0, device=fabric.device)
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum")
                correct += (output.argmax(dim=1) == target).sum()
        test_loss = fabric.all_gather(test_loss).sum() / len(test_loader.dataset)
        accuracy = 100.0 * fabric.all_gather(correct).sum() / len(test_loader.dataset)
        fabric.print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {accuracy:.1f}%")
    fabric.save(out / "classifier.pt", {"model": model})
    return {"losses": losses, "accuracy": float(accuracy)}


def kfold(fabric: Fabric, folds: int) -> dict:
    dataset = make_data(120)
    size = len(dataset) // folds
    scores = []
    for fold in range(folds):
        val_ids = list(range(fold * size, (fold + 1) * size))
        train_ids = [i for i in range(len(dataset)) if i not in set(val_ids)]
        train_loader = DataLoader(dataset, batch_size=16, sampler=SubsetRandomSampler(train_ids))
        val_loader = DataLoader(dataset, batch_size=16, sampler=SubsetRandomSampler(val_ids))
        train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)
        model = fabric.setup_module(Classifier())
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        for data, target in train_loader:
            optimizer.zero_grad()
            fabric.backward(F.nll_loss(model(data), target))
            optimizer.step()
        with torch.no_grad():
            correct = sum(int((model(data).argmax(1) == target).sum()) for data, target in val_loader)
        scores.append(correct / size)
    return {"fold_accuracies": scores}


def gan(fabric: Fabric, steps: int) -> dict:
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    discriminator = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    generator, opt_g = fabric.setup(generator, opt_g)
    discriminator, opt_d = fabric.setup(discriminator, opt_d)
    real_data = torch.randn(64, 2, generator=torch.Generator().manual_seed(3)) * 0.5 + 2.0
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(real_data), batch_size=16, shuffle=True))
    criterion = nn.BCEWithLogitsLoss()
    d_losses, g_losses = [], []
    for _ in range(steps):
        for (real,) in loader:
            noise = torch.randn(real.size(0), 4, device=fabric.device)
            fake = generator(noise)
            discriminator.zero_grad()
            err_d = criterion(discriminator(real), torch.ones(real.size(0), 1, device=fabric.device))
            err_d = err_d + criterion(discriminator(fake.detach()), torch.zeros(real.size(0), 1, device=fabric.device))
            fabric.backward(err_d)
            opt_d.step()
            generator.zero_grad()
            err_g = criterion(discriminator(fake), torch.ones(real.size(0), 1, device=fabric.device))
            fabric.backward(err_g)
            opt_g.step()
        d_losses.append(err_d.item())
        g_losses.append(err_g.item())
    return {"d_losses": d_losses, "g_losses": g_losses}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    seed_everything(42)
    fabric = Fabric(accelerator="cpu", devices=1)  # no fabric.launch(): Lightning's examples don't call it
    out = Path(args.out)
    results = {"classifier": classifier(fabric, 4, out), "kfold": kfold(fabric, folds=3), "gan": gan(fabric, steps=3)}
    if fabric.is_global_zero:
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
