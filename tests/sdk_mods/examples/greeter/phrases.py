"""Phrases for the greeter mod (a module of a mod package, like the airline agent's)."""

GREETING = " Greetings from a package!"
