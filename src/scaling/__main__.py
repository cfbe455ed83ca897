from src.scaling import main

main()
