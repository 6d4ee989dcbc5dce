from pgcascade.cli.main import main

main()
