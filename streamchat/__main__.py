from streamchat.app.cli import main

main()
