from fxsplit.cli import main

main()
