from pgcascade.cli import main

main()
