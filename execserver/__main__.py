from execserver.cli import main

main()
