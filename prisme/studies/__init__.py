"""Studies: the associative-recall showcase (`recall`), the text study (`text`) and `prisme demo` (`demo`)."""
