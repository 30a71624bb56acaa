"""The `omrl` subcommands that have no module of their own elsewhere: each module has
`add_args(parser)` and `main(args)`, and imports what it runs inside `main` (deploy/cli.py
builds every parser for `omrl --help`)."""
