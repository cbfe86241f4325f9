"""The top floor: the ``kvfleet`` command line, the local cluster, the demo, the generate client and
the model maker. Everything below it (the services and the ground, ``kvfleet.core``) imports
nothing from here."""
