"""Named methods and the one resolver: every method builds what it names, a mistake is caught once with one message
(before a model loads where the plan says enough, when the pieces are built otherwise), and the defaults are spelled
once."""

import pytest
from conftest import tiny_model

from verispec import VerispecError, resolve
from verispec.drafters import NgramDrafter, NoDrafter
from verispec.methods import DEFAULT_TREE, METHODS
from verispec.tree import Tree


def test_methods_registry():
    assert resolve("adasd").verifier.name == "adasd" and resolve("adasd").policy == "adasd-entropy"
    assert resolve("adasd-gen-only").verifier.name == "chain"
    assert resolve("adasd-verify-only").policy == "fixed" and resolve("adasd-verify-only").tree_for().max_depth == 5
    assert resolve("adasd-hybrid").policy == "hf"
    assert resolve("default").policy == "auto" and resolve("default").tree == "auto"
    for m in METHODS.values():
        run = resolve(m.name).build()
        assert (run.verifier_state is not None) == (run.verifier.new_state is not None)
        assert run.policy.name == m.policy  # the policy the row names is the one it builds
        assert (run.tree.size == 1) == (m.tree == "none")  # a drafting method drafts something
    with pytest.raises(Exception, match="unknown method"):
        resolve("nope")


def test_deprecated_method_spelling_still_works_with_a_note():
    notes = []
    plan = resolve("specinfer@2x2", info=notes.append)
    assert plan.verifier.name == "specinfer" and plan.tree == "2x2" and plan.children == "iid"
    assert "deprecated" in notes[0]
    plan = resolve(None, verifier="topk", tree="3,1", info=notes.append)
    assert plan.name == "default" and plan.verifier.name == "topk" and plan.policy == "auto" and plan.children == "topk"
    assert len(notes) == 1


@pytest.mark.parametrize("kw,message", [
    (dict(verifier="chain", tree="2x2"), "only verifies chains"),
    (dict(verifier="topk", tree="2x2", children="iid"), "needs --children topk"),
    (dict(verifier="greedy", temperature=0.6), "temperature 0 only"),
    (dict(verifier="greedy", tree="dyn:4,3,7", policy="auto"), "dynamic tree chooses its own depth"),
    (dict(method="fixed", verifier="specinfer", tree="dyn:4,3,7", temperature=0.6), "children topk"),
])
def test_one_check_one_message_per_mistake(kw, message):
    with pytest.raises(VerispecError, match=message):
        resolve(**kw)


def test_an_auto_tree_is_checked_when_the_draft_is_known():
    class Tuned(NgramDrafter):
        default_tree = "2x2"

    plan = resolve(verifier="chain")  # the tree is the draft's: nothing to check yet
    assert plan.tree == "auto"
    with pytest.raises(VerispecError, match="only verifies chains"):
        plan.build(None, Tuned(97))
    assert plan.build(None, NgramDrafter(97)).tree == Tree.parse(DEFAULT_TREE)  # no tuned tree: the default
    assert plan.build(None, NoDrafter()).tree == Tree.root_only()  # plain decoding drafts nothing


def test_generate_takes_names_objects_or_a_recipe_and_its_defaults_are_the_method_default():
    """The library's ``generate`` decodes what ``verispec generate`` does with no options (the method ``default``),
    and a recipe built once (``Plan.build``, as the CLI does) is decoded with as it is."""
    from verispec import generate, get_verifier, resolve

    target = tiny_model("llama")
    prompt = [5, 17, 33, 8, 61, 42]
    drafter = NgramDrafter(target.vocab_size)
    by_name = generate(target, drafter, "chain", prompt, max_new_tokens=12, temperature=0.7, seed=2)
    by_recipe = generate(target, drafter, resolve("default").build(target, drafter), prompt, max_new_tokens=12,
                         temperature=0.7, seed=2)
    by_object = generate(target, drafter, get_verifier("chain"), prompt, tree="auto", policy="auto",
                         max_new_tokens=12, temperature=0.7, seed=2)
    assert by_name.token_ids == by_recipe.token_ids == by_object.token_ids
    assert by_name.config["policy"] == "auto" and by_name.config["verifier"] == "chain"
    assert by_name.config["tree"] == list(resolve("default").tree_for(drafter).parents)
    fixed = generate(target, drafter, "chain", prompt, tree=DEFAULT_TREE, policy="fixed", max_new_tokens=12,
                     temperature=0.7, seed=2)
    assert fixed.config["policy"] == "fixed"
    with pytest.raises(VerispecError, match="as it is"):
        generate(target, drafter, resolve("default").build(target, drafter), prompt, tree="chain:2")