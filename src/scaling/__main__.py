from src.scaling.predict import main

main()
