from streamchat.cli import main

main()
