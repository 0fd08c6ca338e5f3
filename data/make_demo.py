"""Write the demo dataset, data/demo/{train,validation,test,sample_submission}.csv: templated chit-chat about
plans, each with a one-sentence summary, written by this script (no third-party text), seeded so every run
writes the same files.

    python data/make_demo.py
"""
import csv
import os
import random

NAMES = ["Amanda", "Ben", "Chloe", "Daniel", "Emma", "Felix", "Grace", "Hannah", "Isaac", "Jack", "Kate", "Leo",
         "Mia", "Noah", "Olivia", "Paul", "Rosa", "Sam", "Tina", "Victor", "Wendy", "Zoe", "Adam", "Lucy"]
# activity -> places where it happens
ACTIVITIES = {
    "watch a movie": ["the cinema", "Ben's place", "the open-air screen"],
    "have lunch": ["the canteen", "the sushi bar", "Luigi's"],
    "have dinner": ["the Thai place", "Luigi's", "the steakhouse"],
    "play tennis": ["the park courts", "the sports centre"],
    "go for a run": ["the park", "the river path"],
    "study for the exam": ["the library", "the cafe on Main Street"],
    "grab a coffee": ["the cafe on Main Street", "Starbucks", "the bakery"],
    "go shopping": ["the mall", "the market"],
    "go swimming": ["the pool", "the lake"],
    "see the concert": ["the town hall", "the stadium"],
    "play board games": ["Chloe's flat", "the game cafe"],
    "work out": ["the gym", "the climbing hall"],
    "see the new exhibition": ["the art museum", "the science museum"],
    "have a picnic": ["the park", "the beach"],
}
TIMES = ["on Monday", "on Tuesday", "on Wednesday", "on Thursday", "on Friday", "on Saturday", "on Sunday",
         "tonight", "tomorrow", "tomorrow morning", "on Friday evening", "at the weekend", "next week"]
HOURS = ["at 5", "at 6", "at 7", "at 8", "at noon", "at 10", "at 3"]
REASONS = ["work", "a cold", "a family dinner", "a deadline", "a dentist appointment", "an exam"]
ITEMS = ["the snacks", "some drinks", "the cake", "the tickets", "a blanket", "the speaker", "the charger"]
GREETINGS = ["Hi {b}!", "Hey {b}", "Hello {b} :)", "{b}, you there?", "Hiya"]
CLOSINGS = [("Great, see you then!", "See you!"), ("Perfect", "Bye :)"), ("Cool", "Cool"), ("Can't wait!", ":)")]


def agreed(rng, a, b, activity, place, time):
    asks = [f"Do you want to {activity} {time}?", f"Shall we {activity} {time}?",
            f"Fancy going to {place} to {activity} {time}?", f"Would you like to {activity} with me {time}?"]
    yes = ["Sure! Where?", "Yes, good idea. Where?", "Sounds great, where should we go?", "Why not. Where?"]
    where = [f"How about {place}?", f"Let's go to {place}.", f"{place.capitalize()}?"]
    turns = [(a, rng.choice(asks)), (b, rng.choice(yes)), (a, rng.choice(where)), (b, "OK, deal.")]
    return turns, f"{a} and {b} will {activity} at {place} {time}."


def declined(rng, a, b, activity, place, time):
    reason = rng.choice(REASONS)
    asks = [f"Do you want to {activity} at {place} {time}?", f"Shall we {activity} at {place} {time}?",
            f"Are you free to {activity} {time}? I was thinking {place}."]
    no = [f"Sorry, I can't, I have {reason}.", f"I'd love to but I have {reason}.", f"Can't, {reason} :("]
    turns = [(a, rng.choice(asks)), (b, rng.choice(no)), (a, "No worries, another time then.")]
    return turns, f"{b} can't {activity} with {a} {time} because of {reason}."


def moved(rng, a, b, activity, place, time):
    later = rng.choice([t for t in TIMES if t != time])
    turns = [(a, f"Are we still going to {activity} at {place} {time}?"),
             (b, rng.choice([f"Can we do it {later} instead?", f"Could we move it to {later}?"])),
             (a, rng.choice([f"Fine, {later} works for me.", f"OK, {later} then."]))]
    return turns, f"{a} and {b} will {activity} at {place} {later} instead of {time}."


def group(rng, a, b, activity, place, time):
    c = rng.choice([n for n in NAMES if n not in (a, b)])
    hour = rng.choice(HOURS)
    turns = [(a, f"Hey guys, who wants to {activity} {time}?"), (b, "Me!"),
             (c, rng.choice(["Count me in", "I'm in too", "Me too!"])),
             (a, f"Great, let's meet at {place} {hour}.")]
    return turns, f"{a}, {b} and {c} will {activity} at {place} {time} {hour}."


def bring(rng, a, b, activity, place, time):
    item = rng.choice(ITEMS)
    turns = [(a, f"We {activity} at {place} {time}, right?"), (b, "Yes!"),
             (a, rng.choice([f"Can you bring {item}?", f"Could you take care of {item}?"])),
             (b, rng.choice(["Sure, no problem.", "Of course.", "OK, will do."]))]
    return turns, f"{b} will bring {item} when {a} and {b} {activity} at {place} {time}."


def late(rng, a, b, activity, place, time):
    minutes = rng.choice([5, 10, 15, 20, 30])
    turns = [(a, rng.choice([f"I'm running {minutes} minutes late, sorry!",
                             f"Sorry, I'll be {minutes} minutes late."])),
             (b, f"No problem, I'm already at {place}."),
             (a, rng.choice(["Order something for me", "Be there soon"]))]
    return turns, f"{a} will be {minutes} minutes late to meet {b} at {place}."


SCENES = [agreed, agreed, declined, moved, group, bring, late]


def dialogue_and_summary(rng):
    a, b = rng.sample(NAMES, 2)
    activity = rng.choice(list(ACTIVITIES))
    turns, summary = rng.choice(SCENES)(rng, a, b, activity, rng.choice(ACTIVITIES[activity]), rng.choice(TIMES))
    if rng.random() < 0.5:
        turns.insert(0, (a, rng.choice(GREETINGS).format(b=b)))
    if rng.random() < 0.4:
        first, second = rng.choice(CLOSINGS)
        turns += [(a, first), (b, second)]
    return "\n".join(f"{speaker}: {text}" for speaker, text in turns), summary


def write(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")


def main(out_dir=DEMO_DIR, seed=0):
    rng = random.Random(seed)
    os.makedirs(out_dir, exist_ok=True)
    sizes = {"train": 1600, "validation": 100, "test": 100}
    examples = {split: [dialogue_and_summary(rng) for _ in range(n)] for split, n in sizes.items()}
    for split in ("train", "validation"):
        write(os.path.join(out_dir, f"{split}.csv"), ["id", "dialogue", "summary"],
              [(f"{split}-{i:04d}", d, s) for i, (d, s) in enumerate(examples[split])])
    test_ids = [f"test-{i:04d}" for i in range(sizes["test"])]
    write(os.path.join(out_dir, "test.csv"), ["id", "dialogue"],
          zip(test_ids, (d for d, _ in examples["test"]), strict=True))
    write(os.path.join(out_dir, "sample_submission.csv"), ["id", "summary"], ((i, "") for i in test_ids))
    print(f"wrote {', '.join(f'{n} {split}' for split, n in sizes.items())} rows to {out_dir}")


if __name__ == "__main__":
    main()
