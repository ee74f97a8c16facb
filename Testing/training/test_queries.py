"""Query generation (medvoltrain.queries): seeded, held-out descriptions kept out of training, the
paraphrase set for relational queries, and an explicit query for an unknown term (no model needed)."""

from __future__ import annotations

import pytest

from medvoltrain.queries import QueryBank, names_label, split_descriptions


def test_queries_are_deterministic_for_a_seed_and_vary_with_it():
    bank = QueryBank()
    a = [bank.draw(f"case{i}", "liver", "train", seed=3).text for i in range(12)]
    b = [QueryBank().draw(f"case{i}", "liver", "train", seed=3).text for i in reversed(range(12))][::-1]
    c = [bank.draw(f"case{i}", "liver", "train", seed=4).text for i in range(12)]
    assert a == b and a != c
    assert len(set(a)) > 3  # drawn, not constant


@pytest.mark.parametrize("label", ["liver", "kidneys", "kidney tumor", "kidney cyst", "spleen", "left kidney"])
def test_held_out_descriptions_never_reach_training_queries(label):
    bank = QueryBank(test_fraction=0.25)
    train, test = bank.descriptions(label, "train"), bank.descriptions(label, "test")
    assert train and test and not set(train) & set(test)
    train_used = {bank.draw(f"c{i}", label, "train", seed=s).description for i in range(30) for s in range(3)}
    test_used = {bank.draw(f"c{i}", label, "test", seed=s).description for i in range(30) for s in range(3)}
    assert train_used <= set(train) and test_used <= set(test) and not train_used & test_used
    # implicit queries never name their own label
    assert not any(names_label(d, label) for d in train_used | test_used)
    # the split does not depend on the seed or on the order of the descriptions
    pool = train + test
    assert set(split_descriptions(pool, 0.25)["test"]) == set(split_descriptions(pool[::-1], 0.25)["test"]) == set(test)


def test_description_filter():
    assert names_label("Left kidney is one of a pair of bean-shaped organs.", "left kidney")
    assert names_label("Stones form in the gall bladder.", "gallbladder")  # compound spellings
    assert names_label("Anomalous growth leading to a tumor in the kidney.", "kidney tumor")
    assert not names_label("Abnormal growth of cells in the kidney.", "kidney tumor")
    assert names_label("The livers of adults", "liver")
    assert not names_label("Produces bile, a fluid that aids digestion.", "liver")


def test_relational_queries_come_from_the_paraphrase_set():
    from medvoltrain import resources

    spec = resources.relational_queries()["datasets"]["0004"]
    q = QueryBank().draw_relational("kits_1", "0004", "kidney cyst", seed=0)
    assert q.kind == "relational" and q.description in spec["lesions"]["kidney cyst"]
    assert q.text == q.template.replace("{lesion}", q.description) and "kidney" in q.text
    assert q == QueryBank().draw_relational("kits_1", "0004", "kidney cyst", seed=0)


def test_unknown_term_falls_back_to_an_explicit_query_with_a_note():
    q = QueryBank().draw("c", "some organ nobody described", "train", seed=0)
    assert q.kind == "explicit" and "some organ nobody described" in q.text and q.notes
