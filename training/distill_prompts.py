"""Prompts for distilling the draft, all written for this project (no third-party text).

Stage 1 asks for open-ended answers across the kinds of requests a chat model sees (writing, role
play, reasoning, arithmetic, code, science and humanities explanations, short questions, sentences
to translate). Stage 2 builds long-context prompts (summaries, extraction, questions over passages,
translation back to English) from the target's own stage-1 answers, so the draft also sees
positions far into a sequence and text it must copy from. The prompts are generated from lists
and templates with a fixed seed; Spec-Bench is never used.

    python training/distill_prompts.py stage1 --out data/stage1.jsonl
    python training/distill_prompts.py stage2 --answers data/stage1_answers.jsonl --out data/stage2.jsonl
"""
from __future__ import annotations

import argparse
import json
import random

TOPICS = [
    "urban gardening", "electric bicycles", "the history of the printing press", "remote work",
    "ocean plastic", "learning a second language", "public libraries", "solar panels on rooftops",
    "the invention of the telephone", "sleep and memory", "volcanoes", "honey bees", "chess openings",
    "the Silk Road", "board games for families", "space telescopes", "recycling electronics",
    "fermented foods", "marathon training", "the water cycle", "coral reefs", "ancient Rome",
    "jazz music", "smartphone addiction", "wind farms", "the human immune system", "minimalism",
    "volunteering", "self-driving cars", "rainforests", "the Renaissance", "budget travel",
    "climate adaptation in cities", "open-source software", "photography for beginners",
    "time management", "the history of chocolate", "mountain hiking safety", "3D printing",
    "bird migration", "cybersecurity at home", "the Olympic Games", "desert ecosystems",
    "community theatre", "healthy breakfast habits", "the first moon landing", "bridges",
    "artificial intelligence in medicine", "saving money as a student", "glaciers",
    "the history of vaccines", "public transport", "mindfulness", "the Great Wall of China",
    "video game design", "tea ceremonies", "earthquakes", "sustainable fashion", "robots in factories",
    "the stock market", "dinosaurs", "the printing of money", "podcasts", "homework",
    "quantum computers", "the Amazon river", "kindness at work", "old maps", "street food",
]

CONCEPTS = [
    "photosynthesis", "black holes", "inflation", "supply and demand", "natural selection",
    "the Pythagorean theorem", "electric current", "DNA replication", "the greenhouse effect",
    "compound interest", "plate tectonics", "machine learning", "the speed of light", "entropy",
    "vaccines", "the French Revolution", "democracy", "the Industrial Revolution", "opportunity cost",
    "gravity", "recursion in programming", "the theory of relativity", "osmosis", "prime numbers",
    "probability", "the scientific method", "nuclear fission", "the nervous system", "hash tables",
    "binary search", "the cold war", "impressionism", "existentialism", "the Roman Empire",
    "the Magna Carta", "cell division", "sound waves", "magnetism", "chemical bonds", "exponents",
    "derivatives in calculus", "the stoics", "the printing press", "colonialism", "the Big Bang",
    "antibiotic resistance", "climate change", "blockchains", "neural networks", "photosynthesis in algae",
    "the periodic table", "ocean tides", "the human heart", "friction", "the Baroque period",
    "game theory", "globalization", "the Renaissance", "utilitarianism", "sorting algorithms",
]

CODING_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a text", "merges two sorted lists", "removes duplicates from a list while keeping order",
    "finds the longest common prefix of a list of strings", "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome", "flattens a nested list", "computes the factorial of n",
    "finds the maximum subarray sum", "validates an email address with a regular expression",
    "reads a CSV file and returns the average of a column", "implements binary search",
    "sorts a list of dictionaries by a key", "counts the vowels in a string", "transposes a matrix",
    "returns the greatest common divisor of two numbers", "generates all permutations of a list",
    "implements a stack class with push and pop", "parses a date string into year, month and day",
    "computes the mean, median and mode of a list", "checks whether two strings are anagrams",
    "implements bubble sort", "finds the second largest number in a list", "converts a number to Roman numerals",
    "rotates a list by k positions", "implements a simple LRU cache", "counts the frequency of each character",
    "checks whether brackets in a string are balanced", "returns the intersection of two lists",
    "implements a queue using two stacks", "finds all files with a given extension in a folder",
    "computes the distance between two points", "capitalizes the first letter of every word",
    "splits a list into chunks of size n", "converts a binary string to an integer",
    "computes the power set of a set", "finds the missing number in a list from 1 to n",
]
LANGUAGES_CODE = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Rust", "Go"]

ROLES = [
    ("a ship captain in the 18th century", "Describe a storm you survived."),
    ("a tour guide in Paris", "What should I see on my first day?"),
    ("a detective", "Explain how you solved your most famous case."),
    ("a medieval blacksmith", "Tell me about your daily work."),
    ("an astronaut on the space station", "What does a typical morning look like?"),
    ("a chef in a busy restaurant", "Give me your advice for cooking pasta."),
    ("a personal fitness coach", "Make me a weekly workout plan."),
    ("a librarian", "Recommend three books for a rainy weekend."),
    ("a famous inventor", "How did you come up with your best idea?"),
    ("a wise old tree", "What have you learned from watching people?"),
    ("a customer support agent", "My internet connection keeps dropping. What should I do?"),
    ("a history teacher", "Why did the Roman Empire fall?"),
    ("a job interviewer", "Ask me three questions and explain what you look for."),
    ("a travel agent", "Plan a three-day trip to Japan."),
    ("a pirate", "Tell me where you hid your treasure."),
    ("a gardener", "How do I grow tomatoes on a balcony?"),
    ("a museum curator", "Introduce the most important painting in your museum."),
    ("a sports commentator", "Describe the last minute of a close football match."),
    ("a robot learning about humans", "What confuses you most about people?"),
    ("a doctor", "How can I sleep better?"),
]

WRITING = [
    "Write a short blog post about {topic}.", "Write a persuasive paragraph on why people should care about {topic}.",
    "Compose a short poem about {topic}.", "Write a news article about a new discovery related to {topic}.",
    "Write an email to a colleague proposing a workshop on {topic}.", "Write a short story that involves {topic}.",
    "Give me five tips about {topic}.", "Write a speech for a school event about {topic}.",
    "Describe the pros and cons of {topic}.", "Write a product description for a book about {topic}.",
    "Create an outline for a presentation on {topic}.", "Write a diary entry of someone discovering {topic}.",
]
EXPLAIN = [
    "Explain {concept} in simple terms.", "What is {concept}? Give an example.",
    "How would you explain {concept} to a ten-year-old?", "Why is {concept} important?",
    "Summarize the key ideas behind {concept}.", "What are common misconceptions about {concept}?",
    "Compare {concept} and {other}.", "Write a short lesson plan about {concept}.",
]
NAMES = ["Anna", "Ben", "Carla", "David", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena",
         "Maya", "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = [("apples", "kilogram"), ("notebooks", "pack"), ("tickets", "ticket"), ("cupcakes", "box"),
         ("pencils", "box"), ("plants", "pot"), ("books", "book"), ("shirts", "shirt")]
ENGLISH_SENTENCES = [
    "The weather was cold, so we stayed inside and read books.", "My brother works at a hospital in the city.",
    "Could you tell me where the train station is?", "We are planning a trip to the mountains next summer.",
    "The museum opens at nine o'clock every morning.", "She has been learning to play the piano for three years.",
    "The children played in the park until it got dark.", "I would like to order a cup of coffee and a sandwich.",
    "The government announced new rules for public transport.", "Our team won the match after a difficult game.",
    "He forgot his keys at home and had to wait outside.", "The new library has more than ten thousand books.",
    "Please close the window before you leave the room.", "The scientists published their results last week.",
    "This restaurant serves the best soup in town.", "Tomorrow the shops will be closed because of the holiday.",
    "They built a small house near the river.", "The teacher explained the lesson very clearly.",
    "I need to finish this report before Friday.", "Many people visit the old castle every year.",
]
TARGET_LANGUAGES = ["French", "German", "Spanish", "Italian", "Chinese", "German"]


def arithmetic_problem(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    item, unit = rng.choice(ITEMS)
    a, b, c, price = rng.randint(3, 40), rng.randint(2, 15), rng.randint(2, 9), rng.randint(2, 20)
    forms = [
        f"{name} buys {a} {item} and gives {b} of them to {other}. Then {name} buys {c} more. How many {item} does {name} have now?",
        f"Each {unit} of {item} costs {price} dollars. {name} buys {a} of them and pays with a {price * a + rng.choice([5, 10, 20, 50])} dollar bill. How much change does {name} get?",
        f"{name} reads {b} pages a day. The book has {a * b + c} pages. How many days does it take to finish the book?",
        f"A train travels at {a * 5} km per hour for {c} hours and then at {b * 5} km per hour for {rng.randint(1, 4)} hours. How far does it travel in total?",
        f"{name} has {a * 10} dollars. {name} spends a quarter of it on {item} and {b} dollars on lunch. How much money is left?",
        f"Solve for x: {c}x + {b} = {c * a + b}.", f"What is {rng.choice([10, 15, 20, 25, 40])}% of {a * 20}?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        f"{name} and {other} share {a * c} marbles in the ratio {c}:{rng.randint(1, 5)}. How many marbles does each get?",
        f"Is {rng.randint(50, 400)} a prime number? Explain your reasoning step by step.",
        f"A class has {a + 10} students. {b} of them are absent today and half of the rest go on a trip. How many stay in class?",
    ]
    return rng.choice(forms) + rng.choice(["", " Show your work.", " Think step by step."])


def reasoning_problem(rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    forms = [
        f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain.",
        "If all bloops are razzies and all razzies are lazzies, are all bloops definitely lazzies?",
        f"{a} was born before {b}. {c} was born after {b}. Who is the oldest?",
        "There are three boxes: one has apples, one has oranges, one has both. All labels are wrong. You may take one fruit from one box. How do you fix the labels?",
        f"{a} says: '{b} is lying.' {b} says: '{c} is lying.' {c} says: 'Both {a} and {b} are lying.' Who tells the truth?",
        f"A farmer has {rng.randint(10, 30)} sheep and all but {rng.randint(3, 9)} run away. How many are left?",
        f"What comes next in the sequence {', '.join(str(x) for x in [2 * i + 1 for i in range(rng.randint(3, 6))])}, ...? Explain the pattern.",
        f"If it takes {rng.randint(3, 8)} machines {rng.randint(3, 8)} minutes to make the same number of widgets, how long would 100 machines take to make 100 widgets?",
    ]
    return rng.choice(forms)


def stage1(seed: int = 0, count: int = 1600, exclude: frozenset = frozenset(), id_prefix: str = "") -> list[dict]:
    """`count` distinct prompts; texts in `exclude` (an earlier stage's) are skipped but keep their
    number, so a prompt's id is the same with and without the exclusion."""
    rng = random.Random(seed)
    makers = [
        ("writing", lambda: rng.choice(WRITING).format(topic=rng.choice(TOPICS))),
        ("roleplay", lambda: "Pretend you are {}. {}".format(*rng.choice(ROLES))),
        ("explain", lambda: rng.choice(EXPLAIN).format(concept=rng.choice(CONCEPTS), other=rng.choice(CONCEPTS))),
        ("math", lambda: arithmetic_problem(rng)),
        ("reasoning", lambda: reasoning_problem(rng)),
        ("coding", lambda: f"Write a {rng.choice(LANGUAGES_CODE)} function that {rng.choice(CODING_TASKS)}."
                           + rng.choice(["", " Add comments.", " Include an example.", " Explain how it works."])),
        ("qa", lambda: rng.choice(["What is {t}?", "Who first studied {t}?", "Where can I learn about {t}?",
                                   "Give a one-sentence definition of {t}.", "Name three facts about {t}."]
                                  ).format(t=rng.choice(CONCEPTS + TOPICS))),
        ("translate", lambda: f"Translate into {rng.choice(TARGET_LANGUAGES)}: {rng.choice(ENGLISH_SENTENCES)}"),
        ("article", lambda: f"Write a detailed news article of about 200 words about {rng.choice(TOPICS)}."),
    ]
    weights = [3, 1, 3, 2, 1, 2, 1, 1, 3]
    prompts, seen = [], set()
    while len(prompts) < count:
        kind, make = rng.choices(makers, weights)[0]
        text = make()
        if text not in seen:
            seen.add(text)
            if text not in exclude:
                prompts.append(dict(id=f"{id_prefix}s1-{len(seen) - 1:05d}-{kind}", prompt=text))
    return prompts


def stage2(answers: list[dict], seed: int = 1, count: int = 700) -> list[dict]:
    """Long-context prompts over the target's own stage-1 texts (articles, explanations, translations)."""
    rng = random.Random(seed)
    documents = [a["text"].replace("<|im_end|>", "").strip() for a in answers
                 if a["id"].split("-")[-1] in ("article", "writing", "explain") and a["num_tokens"] >= 80]
    translations = [a["text"].replace("<|im_end|>", "").strip() for a in answers
                    if a["id"].endswith("translate") and a["num_tokens"] >= 5]
    questions = ["What is the main point of the text?", "Which facts are mentioned?", "Who is involved?",
                 "What problem does the text describe?", "What does the text recommend?"]
    makers = [
        ("summary", lambda d: f"Summarize the following article in three sentences.\n\n{d[0]}"),
        ("summary", lambda d: f"{d[0]}\n\nTL;DR: write a short summary of the text above."),
        ("extract", lambda d: f"Extract the key facts from this text as a bulleted list.\n\n{d[0]}"),
        ("extract", lambda d: f"Read the text and list every number, name and place it mentions.\n\n{d[0]}"),
        ("rag", lambda d: f"Answer the question using only the passages.\n\nPassage 1: {d[0]}\n\nPassage 2: {d[1]}"
                          f"\n\nQuestion: {rng.choice(questions)}"),
        ("rewrite", lambda d: f"Rewrite the following text in a more formal style.\n\n{d[0]}"),
        ("qa_doc", lambda d: f"{d[0]}\n\nBased on the text above, {rng.choice(questions).lower()}"),
    ]
    prompts = []
    for i in range(count):
        if translations and i % 7 == 6:
            prompts.append(dict(id=f"s2-{i:05d}-backtranslate",
                                prompt=f"Translate the following text into English: {rng.choice(translations)}"))
            continue
        kind, make = rng.choice(makers)
        prompts.append(dict(id=f"s2-{i:05d}-{kind}", prompt=make(rng.sample(documents, 2))))
    return prompts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["stage1", "stage2"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--answers", help="stage-1 answers (JSONL from `specbatch generate`), for stage2")
    parser.add_argument("--count", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", nargs="*", default=[], help="stage1: prompt files whose prompts to skip "
                        "(more data from another seed without repeating a stage)")
    parser.add_argument("--id-prefix", default="", help="stage1: prefix of every id (e.g. s3-)")
    args = parser.parse_args()
    if args.stage == "stage1":
        exclude = set()
        for name in args.exclude:
            with open(name) as f:
                exclude |= {json.loads(line)["prompt"] for line in f if line.strip()}
        prompts = stage1(args.seed, args.count or 1600, frozenset(exclude), args.id_prefix)
    else:
        with open(args.answers) as f:
            answers = [json.loads(line) for line in f if line.strip()]
        prompts = stage2(answers, args.seed + 1, args.count or 700)
    with open(args.out, "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    print(f"{len(prompts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
