"""The text attacks' figures in docs/results.md, measured on this machine: the Bayes adversary on relaxed tokens
against TAG under defenses and FedAvg, DAGER's exhaustive search on an encoder, the attacks on the real corpus, and
a keyboard's language model (next-token targets) beside the classifier, both under DP-SGD, and adapter_span on
LoRA updates.

    python benchmarks/text_attacks.py [--section bayes|encoder|corpus|keyboard|dpsgd|adapters] [--iterations 300]

Every model is the zoo's, untrained, seeded (torch.manual_seed(0)); every attack starts from seed 0. Prints
markdown rows with each attack's ROUGE-1 / ROUGE-2 and its wall time on this CPU.
"""
from __future__ import annotations

import argparse
import time

import torch

from leakaudit.attacks.text import AdapterSpan, BayesText, Dager, Lamp, Tag
from leakaudit.defenses.dpsgd import DPSGD
from leakaudit.defenses.noise import GaussianNoise, NoDefense
from leakaudit.defenses.pruning import RandomPrune, TopK
from leakaudit.defenses.text import Lora, draw_adapters
from leakaudit.evaluator.zoo.text import (TinyTransformer, classification_loss, load_pii_sentences,
                                          load_python_reference, rouge, text_assignment)
from leakaudit.plugins.attack import ThreatModel
from leakaudit.plugins.protocol import FEDSGD, ClientStep, FedAvg
from leakaudit.plugins.text import next_token_loss


def threat_of(model, data, batch: int, defense, protocol=FEDSGD, labels=None) -> ThreatModel:
    length, loss = data.length, next_token_loss if data.task == "next_token" else classification_loss
    return ThreatModel(model, loss, (length,), torch.zeros(1), torch.ones(1), data.num_classes,
                       batch, defense, labels=labels, protocol=protocol)


def scored(rows, x) -> str:
    rows = rows[text_assignment(rows, x)]
    return f"{rouge(rows, x, 'rouge1').mean():.3f} / {rouge(rows, x, 'rouge2').mean():.3f}"


def run(attack, update, threat) -> tuple[str, float, dict]:
    start = time.perf_counter()
    rec = attack(update, threat, torch.Generator().manual_seed(0))
    return rec.images, time.perf_counter() - start, rec.extras


def bayes(iterations: int) -> None:
    """TAG against bayes_text on one 14-token PII sentence, 2 layers, width 128."""
    data = load_pii_sentences(length=16)
    index = next(i for i in range(len(data.test_x)) if int((data.test_x[i] != 0).sum()) == 14)
    x, y = data.test_x[index:index + 1], data.test_y[index:index + 1]
    print("| defense (protocol) | TAG ROUGE-1 / ROUGE-2 | bayes_text ROUGE-1 / ROUGE-2 | seconds (TAG, bayes_text) |")
    print("| --- | --- | --- | --- |")
    cases = [("none (FedSGD)", NoDefense(), FEDSGD), ("prune 0.9", RandomPrune(fraction=0.9), FEDSGD),
             ("topk 5%", TopK(fraction=0.05), FEDSGD), ("gaussian 1e-2", GaussianNoise(sigma=0.01), FEDSGD),
             ("none (FedAvg, 2 local epochs at lr 0.1)", NoDefense(), FedAvg(local_epochs=2, local_lr=0.1))]
    for label, defense, protocol in cases:
        torch.manual_seed(0)
        model = TinyTransformer(data.vocab_size, data.num_classes, 16, layers=2)
        update = defense.share(ClientStep(model, classification_loss, x, y, torch.Generator().manual_seed(1),
                                          protocol))
        threat = threat_of(model, data, 1, defense, protocol, y)
        tag, tag_s, _ = run(Tag(iterations=iterations), update, threat)
        rel, rel_s, _ = run(BayesText(iterations=iterations), update, threat)
        print(f"| {label} | {scored(tag, x)} | {scored(rel, x)} | {tag_s:.1f}, {rel_s:.1f} |")


def encoder(iterations: int) -> None:
    """DAGER on tiny_bert (width 128, 3 layers) at batches of 1, 2 and 4 PII sentences."""
    data = load_pii_sentences(length=16)
    print("| batch | ranks | ROUGE-1 / ROUGE-2 | exact | seconds | note |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch in (1, 2, 4):
        torch.manual_seed(0)
        model = TinyTransformer(data.vocab_size, data.num_classes, 16, width=128, layers=3, causal=False)
        x, y = data.test_x[:batch], data.test_y[:batch]
        update = NoDefense().share(ClientStep(model, classification_loss, x, y, torch.Generator(), FEDSGD))
        rows, seconds, extras = run(Dager(), update, threat_of(model, data, batch, NoDefense(), labels=y))
        exact = (rows[text_assignment(rows, x)] == x).all(1).sum()
        print(f"| {batch} | {extras.get('rank')} | {scored(rows, x)} | {int(exact)} of {batch} | {seconds:.1f} | "
              f"{extras.get('note', '')} |")


def corpus(iterations: int) -> None:
    """The real corpus: DAGER on 8 test sentences at widths 256 and 128; TAG and bayes_text on 3 sentences."""
    data = load_python_reference(length=24)
    print(f"python_reference: {len(data.train_x)} / {len(data.test_x)} sentences, {data.vocab_size} vocabulary "
          f"entries, {int((data.test_x == 1).sum())} test tokens <unk>, "
          f"{float((torch.cat([data.train_x, data.test_x]) != 0).sum(1).float().mean()):.2f} tokens a sentence "
          "(cut at 24)")
    print("| attack | setting | ROUGE-1 / ROUGE-2 | seconds | ranks |")
    print("| --- | --- | --- | --- | --- |")
    x, y = data.test_x[:8], data.test_y[:8]
    for width in (256, 128):
        torch.manual_seed(0)
        model = TinyTransformer(data.vocab_size, data.num_classes, 24, width=width, layers=3)
        update = NoDefense().share(ClientStep(model, classification_loss, x, y, torch.Generator(), FEDSGD))
        rows, seconds, extras = run(Dager(), update, threat_of(model, data, 8, NoDefense(), labels=y))
        exact = int((rows[text_assignment(rows, x)] == x).all(1).sum())
        print(f"| dager | 8 sentences ({int((x != 0).sum())} tokens), width {width}, 3 layers, {exact} of 8 exact | "
              f"{scored(rows, x)} | {seconds:.1f} | {extras.get('rank')} |")
    torch.manual_seed(0)
    model = TinyTransformer(data.vocab_size, data.num_classes, 24, layers=2)
    for i in range(3):
        xi, yi = data.test_x[i:i + 1], data.test_y[i:i + 1]
        update = NoDefense().share(ClientStep(model, classification_loss, xi, yi, torch.Generator(), FEDSGD))
        threat = threat_of(model, data, 1, NoDefense(), labels=yi)
        for attack in (Tag(iterations=iterations), BayesText(iterations=iterations)):
            rows, seconds, _ = run(attack, update, threat)
            print(f"| {attack.name} | test sentence {i} ({int((xi != 0).sum())} tokens), 2 layers | "
                  f"{scored(rows, xi)} | {seconds:.1f} | |")


def keyboard(iterations: int) -> None:
    """The same PII sentences on the classifier (tiny_gpt, one intent per sentence) and on a keyboard's language
    model (tiny_gpt_lm, the next word at every position): TAG, LAMP and bayes_text on four sentences of 10 to 14
    tokens one at a time (2 layers, width 128), bayes_text under Gaussian noise, DAGER on batches (3 layers)."""
    tasks = {"classifier": load_pii_sentences(length=16), "keyboard": load_pii_sentences(length=16, task="next_token")}
    picks = [next(i for i in range(200) if int((tasks["classifier"].test_x[i] != 0).sum()) == n) for n in (10, 11, 12, 14)]

    def cases(data, defense, layers: int = 2):
        for i in picks:
            torch.manual_seed(0)
            model = TinyTransformer(data.vocab_size, data.num_classes, 16, layers=layers,
                                    next_token=data.task == "next_token")
            x, y = data.test_x[i:i + 1], data.test_y[i:i + 1]
            update = defense.share(ClientStep(model, threat_of(model, data, 1, defense).loss_fn, x, y,
                                              torch.Generator().manual_seed(1), FEDSGD))
            yield x, update, threat_of(model, data, 1, defense)

    def mean_of(attack, data, defense) -> tuple[str, float]:
        runs = [(rouge(r, x, "rouge1").item(), rouge(r, x, "rouge2").item(), s)
                for x, update, threat in cases(data, defense) for r, s, _ in [run(attack, update, threat)]]
        r1, r2, seconds = (sum(v) / len(runs) for v in zip(*runs))
        return f"{r1:.3f} / {r2:.3f}", seconds

    print("| model | attack | defense | mean ROUGE-1 / ROUGE-2 (4 sentences) | seconds a sentence |")
    print("| --- | --- | --- | --- | --- |")
    for name, data in tasks.items():
        for attack in (Tag(iterations=iterations), Lamp(iterations=iterations), BayesText(iterations=iterations)):
            scores, seconds = mean_of(attack, data, NoDefense())
            print(f"| {name} | {attack.name} | none | {scores} | {seconds:.1f} |")
        for sigma in (1e-2, 1e-1, 1.0):
            scores, seconds = mean_of(BayesText(iterations=iterations), data, GaussianNoise(sigma=sigma))
            print(f"| {name} | bayes_text | gaussian {sigma:g} | {scores} | {seconds:.1f} |")
    print()
    print("| model | batch | ranks | ROUGE-1 / ROUGE-2 | exact | seconds | note |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, data in tasks.items():
        for batch in (8, 16):
            torch.manual_seed(0)
            model = TinyTransformer(data.vocab_size, data.num_classes, 16, width=128, layers=3,
                                    next_token=data.task == "next_token")
            x, y = data.test_x[:batch], data.test_y[:batch]
            threat = threat_of(model, data, batch, NoDefense())
            update = NoDefense().share(ClientStep(model, threat.loss_fn, x, y, torch.Generator(), FEDSGD))
            rows, seconds, extras = run(Dager(), update, threat)
            exact = (rows[text_assignment(rows, x)] == x).all(1).sum()
            print(f"| {name} | {batch} | {extras.get('rank')} | {scored(rows, x)} | {int(exact)} of {batch} | "
                  f"{seconds:.1f} | {extras.get('note', '')} |")


def dpsgd(iterations: int) -> None:
    """bayes_text through DP-SGD's own likelihood (Opacus's update, clipping norm 1) on the classifier and the
    keyboard's language model: two PII sentences of 12 and 14 tokens, one per update, 2 layers, width 128."""
    print("| model | noise multiplier | ROUGE-1 / ROUGE-2 (mean of 2 sentences) | seconds a sentence |")
    print("| --- | --- | --- | --- |")
    for task in ("classify", "next_token"):
        data = load_pii_sentences(length=16, task=task)
        picks = [next(i for i in range(200) if int((data.test_x[i] != 0).sum()) == n) for n in (12, 14)]
        for multiplier in (0.01, 0.1, 1.0):
            runs = []
            for i in picks:
                torch.manual_seed(0)
                model = TinyTransformer(data.vocab_size, data.num_classes, 16, layers=2, next_token=task == "next_token")
                x, y = data.test_x[i:i + 1], data.test_y[i:i + 1]
                defense = DPSGD(noise_multiplier=multiplier, max_grad_norm=1.0)
                threat = threat_of(model, data, 1, defense)
                update = defense.share(ClientStep(model, threat.loss_fn, x, y, torch.Generator().manual_seed(1), FEDSGD))
                rows, seconds, _ = run(BayesText(iterations=iterations), update, threat)
                runs.append((rouge(rows, x, "rouge1").item(), rouge(rows, x, "rouge2").item(), seconds))
            r1, r2, seconds = (sum(v) / len(runs) for v in zip(*runs))
            print(f"| {'keyboard' if task == 'next_token' else 'classifier'} | {multiplier:g} | {r1:.3f} / {r2:.3f} | "
                  f"{seconds:.1f} |")


def adapters(iterations: int) -> None:
    """adapter_span on LoRA updates of tiny_gpt (3 layers), at the adapters' start (B = 0) and with B drawn away
    from zero (as after training), for ranks and batches of 16-token PII sentences; where it refuses, its line."""
    data = load_pii_sentences(length=16)
    print("| width | rank | batch | B | ROUGE-1 / ROUGE-2 | exact | seconds | refused |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for width, rank, batch in ((128, 64, 1), (128, 64, 3), (128, 8, 1), (768, 256, 8), (768, 256, 15), (768, 64, 8)):
        for trained in (False, True):
            torch.manual_seed(0)
            model = Lora(rank=rank).wrap_model(TinyTransformer(data.vocab_size, data.num_classes, 16, width=width,
                                                               layers=3, heads=4))
            if trained:
                draw_adapters(model)
            x, y = data.test_x[:batch], data.test_y[:batch]
            attack = AdapterSpan()
            refused = attack.unsupported(model, batch, FEDSGD)
            update = NoDefense().share(ClientStep(model, classification_loss, x, y, torch.Generator(), FEDSGD))
            rows, seconds, _ = run(attack, update, threat_of(model, data, batch, NoDefense(), labels=y))
            exact = (rows[text_assignment(rows, x)] == x).all(1).sum()
            print(f"| {width} | {rank} | {batch} | {'drawn' if trained else 'zero'} | {scored(rows, x)} | "
                  f"{int(exact)} of {batch} | {seconds:.1f} | {'yes' if refused else 'no'} |")


SECTIONS = {"bayes": bayes, "encoder": encoder, "corpus": corpus, "keyboard": keyboard, "dpsgd": dpsgd,
            "adapters": adapters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append",
                        help="the tables to measure (default: all)")
    parser.add_argument("--iterations", type=int, default=300, help="TAG's and bayes_text's Adam steps")
    args = parser.parse_args()
    for name in args.section or list(SECTIONS):
        print(f"\n## {name}\n")
        SECTIONS[name](args.iterations)


if __name__ == "__main__":
    main()
