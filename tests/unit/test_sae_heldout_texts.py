"""The held-out texts of the SAE's sae-lens evaluation: prose paragraphs out of Info-as-text, and a
package the training corpus does not use (no model, no download)."""

from __future__ import annotations

from pipelines.sae_training.corpus import SOURCES
from pipelines.sae_training.heldout_evals import MIN_CHARS, PACKAGE, paragraphs

DOCUMENT = """3.1 Which Languages to Use
==========================

When you want to use a language that gets compiled and runs at high
speed, the best language to use is C.  C++ is ok too, but please don't
make heavy use of templates.  So is Java, if you compile it.  When
highest efficiency is not required, other languages commonly used in
the free software community are fine as well.

* Menu:

* Source Language::     Which languages to use.
* Compatibility::       Compatibility with other implementations.

     int
     main (int argc, char **argv)
     {
       return 0;
     }

   Many GNU facilities that already exist could be useful here, and the
maintainers of each one would be glad to hear from you before you start
writing a new one from scratch.  Ask on the mailing list first, and
someone will point you to the right place.

Short note.
"""


def test_paragraphs_keeps_prose_and_drops_headings_menus_code_and_short_notes():
    found = paragraphs(DOCUMENT)
    assert len(found) == 2, found
    assert found[0].startswith("When you want to use a language") and "\n" not in found[0]
    assert found[1].startswith("Many GNU facilities") and found[1].endswith("to the right place.")
    assert all(len(p) >= MIN_CHARS for p in found)
    assert not any("int" == p.split()[0] or "Menu" in p or "=====" in p for p in found)


def test_the_held_out_package_is_not_part_of_the_training_corpus():
    assert PACKAGE not in {source.package for source in SOURCES}
