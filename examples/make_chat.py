"""Generated ``examples/chat.jsonl``: a small made-up chat corpus (not taken from any dataset).

Each dialogue picks a topic (ordering coffee, the weather, booking a table, library hours,
train travel, cooking, pets, films, the gym, books, the doctor, gifts, wifi trouble,
gardening), fills the topic's slots once (a drink, a city, a time ...) so the dialogue
stays consistent, and strings together an opening exchange, up to three middle
exchanges (so 4 to 10 turns) and a closing one, each drawn from several wordings. About a
quarter start with a system message; a few split a turn into two messages of one role.
The output is a function of the seed. Rerun from the repository root with::

    .venv/bin/python examples/make_chat.py            # rewrites examples/chat.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20240611
DIALOGUES = 400
OUT = Path(__file__).resolve().parent / "chat.jsonl"

# A topic: slot values, then stages; a stage lists alternative exchanges, "user | assistant".
TOPICS: dict[str, dict[str, list[str]]] = {
    "coffee": {
        "drink": ["latte", "flat white", "cappuccino", "americano", "mocha", "chai latte"],
        "size": ["small", "medium", "large"],
        "milk": ["oat milk", "soy milk", "whole milk", "almond milk"],
        "price": ["3.50", "4.20", "3.80", "4.75"],
        "open": [
            "Hi, can I get a {size} {drink}, please? | Of course. Would you like that hot or iced?",
            "Good morning! One {drink} to go. | Good morning! What size would you like?",
            "Hello, I'd like a {drink}. | Sure thing. Small, medium or large?",
        ],
        "middle": [
            "Hot, please. Can you make it with {milk}? | Yes, we have {milk}. No problem.",
            "{size}, please. | A {size} {drink}, got it.",
            "Do you have any pastries left? | We still have croissants and a few muffins.",
            "Could you add an extra shot? | Sure, one extra shot of espresso.",
            "Is it very sweet? | Not really, but I can add syrup if you like.",
        ],
        "close": [
            "How much is that? | That comes to {price}. You can pay by card or cash.",
            "That's all, thanks. | Great, it will be ready in two minutes.",
            "Perfect, thank you! | You're welcome. Enjoy your {drink}!",
        ],
    },
    "weather": {
        "city": ["Lisbon", "Oslo", "Toronto", "Nairobi", "Kyoto", "Dublin", "Denver"],
        "sky": ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy"],
        "temp": ["twelve", "eighteen", "twenty four", "five", "thirty"],
        "open": [
            "What's the weather like in {city} today? | "
            "It's {sky} in {city}, about {temp} degrees.",
            "Lovely day, isn't it? | It is! Much nicer than yesterday.",
            "Do you think it will rain later? | The forecast says it might, so take an umbrella.",
        ],
        "middle": [
            "Should I bring a jacket? | A light jacket would be a good idea this evening.",
            "Will it be {sky} tomorrow too? | Probably, the next few days look about the same.",
            "I love {sky} weather. | Me too, it makes a nice change.",
            "It was so cold last week. | Yes, it was freezing. I'm glad it warmed up.",
            "Is it good weather for a walk? | Yes, it's a great afternoon for a walk in the park.",
        ],
        "close": [
            "Thanks, have a nice day! | You too, enjoy the weather!",
            "Okay, I'll plan around that. | Good idea. Stay dry!",
            "Great, that's all I wanted to know. | Happy to help. Bye for now.",
        ],
    },
    "table": {
        "people": ["two", "three", "four", "six"],
        "time": ["seven", "half past seven", "eight", "six thirty"],
        "day": ["Friday", "Saturday", "tonight", "tomorrow", "Sunday"],
        "food": ["Italian", "Thai", "Mexican", "Indian", "Japanese"],
        "open": [
            "I'd like to book a table for {people} on {day}. | "
            "Certainly. What time would suit you?",
            "Hi, do you have a table for {people} {day}? | "
            "Let me check. What time were you thinking?",
            "Can I reserve a table at your {food} place? | Of course. For how many people?",
        ],
        "middle": [
            "Around {time}, please. | We have a table at {time}. Shall I book it?",
            "{people} people. | A table for {people}, noted.",
            "Do you have anything by the window? | Yes, there is a window table free.",
            "One of us is vegetarian. | No problem, we have several vegetarian dishes.",
            "Is there parking nearby? | Yes, there is a car park just behind the restaurant.",
        ],
        "close": [
            "Yes, please book it. | Done. Your table is booked for {time} on {day}.",
            "That's perfect, thank you. | You're welcome. See you {day}!",
            "Great, under the name Sam. | All set, Sam. We look forward to seeing you.",
        ],
    },
    "library": {
        "day": ["Monday", "Saturday", "Sunday", "Wednesday"],
        "hour": ["nine", "ten", "eight"],
        "shut": ["six", "eight", "five", "nine"],
        "open": [
            "When does the library open on {day}? | On {day} we open at {hour} in the morning.",
            "Is the library open today? | Yes, we are open until {shut} this evening.",
            "What are your opening hours? | We open at {hour} and close at {shut} on weekdays.",
        ],
        "middle": [
            "Can I renew my books online? | Yes, you can renew them on our website.",
            "How many books can I borrow? | You can borrow up to ten books at a time.",
            "Do you have study rooms? | Yes, you can book a study room at the front desk.",
            "Is there wifi in the library? | Yes, the wifi is free for all members.",
            "I lost my library card. | No worries, we can print a new one for you.",
        ],
        "close": [
            "Thanks for the information. | You're welcome. See you at the library!",
            "Great, I'll come by on {day}. | Sounds good. We close at {shut}.",
            "That's very helpful, thank you. | Happy to help. Enjoy your reading!",
        ],
    },
    "travel": {
        "city": ["Paris", "Berlin", "Madrid", "Vienna", "Prague", "Rome", "Amsterdam"],
        "time": ["eight", "ten", "noon", "three"],
        "price": ["forty", "fifty five", "thirty", "seventy"],
        "open": [
            "I need a train ticket to {city}. | Sure. When would you like to travel?",
            "How do I get to {city} from here? | "
            "The train is the easiest way. It takes about three hours.",
            "Are there any trains to {city} tomorrow? | Yes, there are trains every two hours.",
        ],
        "middle": [
            "Tomorrow morning, around {time}. | There is a train at {time} o'clock.",
            "How much is a return ticket? | A return ticket costs {price} euros.",
            "Is there a direct train? | Yes, the {time} o'clock train is direct.",
            "Can I bring my bike? | Yes, but you need to reserve a bike space.",
            "Do I need to change trains? | No, you can stay on the same train the whole way.",
        ],
        "close": [
            "Okay, I'll take it. | Great, your ticket to {city} is booked.",
            "Thanks, I'll think about it. | No problem. Have a good trip to {city}!",
            "Perfect, thank you so much. | You're welcome. Enjoy {city}!",
        ],
    },
    "cooking": {
        "dish": ["pancakes", "tomato soup", "fried rice", "banana bread", "an omelette", "pasta"],
        "item": ["eggs", "flour", "butter", "garlic", "onions", "milk"],
        "minutes": ["ten", "twenty", "thirty", "forty"],
        "open": [
            "How do I make {dish}? | It's easy. First you need some {item}.",
            "I want to cook {dish} tonight. | Great choice! Do you have {item} at home?",
            "Any idea what I can cook for dinner? | How about {dish}? It's quick and tasty.",
        ],
        "middle": [
            "I have {item}. What next? | Mix everything well and heat the pan.",
            "How long does it take? | About {minutes} minutes from start to finish.",
            "Can I make it without {item}? | Yes, it still works, it's just a little different.",
            "Should I add salt? | Just a pinch of salt is enough.",
            "What heat should I use? | Medium heat, so it cooks through without burning.",
        ],
        "close": [
            "Thanks, I'll try it! | Enjoy your {dish}!",
            "Sounds delicious. | It is! Let me know how it turns out.",
            "Great, I'm off to the kitchen. | Good luck, and have fun cooking.",
        ],
    },
    "pets": {
        "pet": ["dog", "cat", "rabbit", "puppy", "kitten", "parrot"],
        "name": ["Max", "Luna", "Bella", "Charlie", "Milo", "Daisy"],
        "food": ["dry food", "fresh vegetables", "wet food", "special treats"],
        "open": [
            "I just got a {pet} called {name}. | How exciting! How is {name} settling in?",
            "My {pet} keeps me awake at night. | "
            "That can be tiring. Does {name} get enough exercise?",
            "What should I feed my {pet}? | Most vets suggest good quality {food}.",
        ],
        "middle": [
            "{name} sleeps most of the day. | That's normal, young animals sleep a lot.",
            "How often should I take {name} to the vet? | "
            "Once a year for a check up is usually fine.",
            "Can I give {name} {food} every day? | Yes, as long as the portions are right.",
            "{name} loves playing with a ball. | That's great exercise. Keep it up!",
            "Should I get a second {pet}? | It can help with company, but it's more work.",
        ],
        "close": [
            "Thanks for the advice. | You're welcome. Give {name} a pat from me!",
            "I'll try that. | Good luck with {name}!",
            "That makes sense, thanks. | Anytime. Enjoy your new {pet}.",
        ],
    },
    "films": {
        "genre": ["comedy", "thriller", "documentary", "science fiction film", "animated film"],
        "night": ["tonight", "this weekend", "on Friday"],
        "open": [
            "Can you recommend a good {genre}? | Sure! Are you watching alone or with friends?",
            "I want to watch a film {night}. | Nice. What kind of film do you like?",
            "What's showing at the cinema {night}? | "
            "There is a new {genre} everyone is talking about.",
        ],
        "middle": [
            "With friends. | Then a {genre} could be a fun choice.",
            "I like a {genre}. | There are some great ones out this year.",
            "Is it very long? | It's just under two hours.",
            "Is it suitable for kids? | Yes, it's fine for the whole family.",
            "Have you seen it? | I haven't, but the reviews are very good.",
        ],
        "close": [
            "Sounds good, I'll watch it {night}. | Enjoy the film!",
            "Thanks for the tip. | You're welcome. Don't forget the popcorn.",
            "Great, I'll book tickets. | Have a fun evening!",
        ],
    },
    "gym": {
        "sport": ["running", "swimming", "yoga", "cycling", "weight training"],
        "days": ["two", "three", "four"],
        "open": [
            "I want to get fit. Where should I start? | Start small. Do you enjoy {sport}?",
            "How often should I go to the gym? | About {days} times a week is a good start.",
            "I started {sport} last week. | Well done! How are you finding it?",
        ],
        "middle": [
            "Yes, I like {sport}. | Then try {sport} {days} times a week.",
            "My legs are really sore. | That's normal at first. Rest and stretch.",
            "Should I eat before training? | A light snack an hour before is a good idea.",
            "How long should each session be? | Thirty to forty five minutes is plenty.",
            "I get bored easily. | Try a class or train with a friend.",
        ],
        "close": [
            "Thanks, I feel motivated now. | Great! Keep going and have fun.",
            "Okay, I'll give it a try. | Good luck with your {sport}!",
            "That's helpful, thank you. | You're welcome. Remember to drink water.",
        ],
    },
    "books": {
        "kind": ["mystery novel", "fantasy series", "history book", "short story collection"],
        "author": ["a new author", "an old favourite", "a local writer"],
        "open": [
            "I'm looking for a good {kind}. | "
            "I can help. Do you prefer something light or serious?",
            "What are you reading at the moment? | A {kind} by {author}. It's very good.",
            "Can you suggest a book for a long flight? | A {kind} would keep you busy.",
        ],
        "middle": [
            "Something light, please. | Then a {kind} by {author} is a good pick.",
            "How long is it? | About three hundred pages.",
            "Is it part of a series? | Yes, it's the first of three books.",
            "Do you have it as an ebook? | Yes, it's available as an ebook too.",
            "My sister loved that one. | It's very popular this year.",
        ],
        "close": [
            "I'll take it, thanks. | Enjoy your reading!",
            "Great, I'll look for it. | I hope you like it.",
            "Thanks for the recommendation. | Anytime. Happy reading!",
        ],
    },
    "doctor": {
        "day": ["Monday", "Tuesday", "Thursday", "Friday"],
        "time": ["nine thirty", "eleven", "two", "four fifteen"],
        "problem": ["a sore throat", "a bad cough", "a headache", "back pain"],
        "open": [
            "I'd like to make an appointment with a doctor. | "
            "Of course. What seems to be the problem?",
            "Hello, I've had {problem} for three days. | "
            "I'm sorry to hear that. Let's get you an appointment.",
            "Can I see a doctor this week? | Let me check. We have a slot on {day}.",
        ],
        "middle": [
            "I have {problem}. | I see. The doctor can see you on {day} at {time}.",
            "Is there anything earlier? | The earliest is {day} at {time}.",
            "{day} at {time} works for me. | Great, I've put you down for {day} at {time}.",
            "Do I need to bring anything? | Just your health card, please.",
            "Should I take anything until then? | "
            "Rest, drink plenty of water, and call if it gets worse.",
        ],
        "close": [
            "Thank you very much. | You're welcome. Get well soon.",
            "Okay, see you then. | See you on {day}. Take care.",
            "That's all, thanks. | Take care and feel better.",
        ],
    },
    "gift": {
        "person": ["my mum", "my brother", "a colleague", "my best friend", "my grandfather"],
        "budget": ["twenty", "thirty", "fifty"],
        "gift": ["a scarf", "a board game", "a plant", "a nice notebook", "a book voucher"],
        "open": [
            "I need a birthday present for {person}. | Lovely. What does {person} enjoy?",
            "Any gift ideas for {person}? | How about {gift}? People usually like that.",
            "What can I buy for about {budget} pounds? | "
            "For {budget} pounds, {gift} is a good idea.",
        ],
        "middle": [
            "They like being outdoors. | Then {gift} could work well.",
            "My budget is about {budget} pounds. | You can find {gift} for that price.",
            "Should I wrap it myself? | Yes, a handwritten card makes it more personal.",
            "I gave {person} {gift} last year. | Then maybe try something different this time.",
            "Where can I buy it? | The shop on the high street has a good selection.",
        ],
        "close": [
            "Great idea, thanks! | I'm sure {person} will love it.",
            "I'll go with {gift}. | Good choice!",
            "Thanks for helping. | You're welcome. Have a lovely celebration.",
        ],
    },
    "wifi": {
        "device": ["laptop", "phone", "tablet", "printer"],
        "router": ["router", "modem", "wifi box"],
        "open": [
            "My {device} won't connect to the wifi. | "
            "Let's fix that. Have you tried restarting it?",
            "The internet is really slow today. | Sorry about that. Is it slow on every device?",
            "I can't find my wifi network. | Is the {router} switched on and showing lights?",
        ],
        "middle": [
            "Yes, I restarted it. | Okay. Now try turning the {router} off and on again.",
            "Only on my {device}. | Then let's forget the network on the {device} and join again.",
            "The lights are blinking orange. | "
            "That usually means the line is down. Wait a few minutes.",
            "Where do I find the password? | "
            "It's printed on a sticker on the back of the {router}.",
            "Should I call my provider? | If it still fails after a restart, yes.",
        ],
        "close": [
            "It works now, thank you! | Great, glad it's working again.",
            "I'll try that and see. | Good luck. Let me know if it doesn't help.",
            "Thanks, that fixed it. | Happy to help!",
        ],
    },
    "garden": {
        "plant": ["tomatoes", "roses", "basil", "strawberries", "tulips", "sunflowers"],
        "season": ["spring", "early summer", "autumn"],
        "open": [
            "When should I plant {plant}? | {plant} do best when planted in {season}.",
            "My {plant} are not growing well. | Oh no. Are they getting enough sun?",
            "I want to start a small garden. | "
            "How nice! Easy plants like {plant} are a good start.",
        ],
        "middle": [
            "They get sun in the morning. | That should be fine. Water them every other day.",
            "How often should I water them? | Water them when the top of the soil feels dry.",
            "Do they need a big pot? | A medium pot is enough for {plant}.",
            "Slugs keep eating the leaves. | Try crushed eggshells around the plants.",
            "Should I use fertiliser? | A little in {season} helps them grow.",
        ],
        "close": [
            "Thanks, I'll try that. | Good luck with your {plant}!",
            "That's really helpful. | Happy gardening!",
            "Great, thank you. | You're welcome. Enjoy the garden.",
        ],
    },
}
STAGES = ("open", "middle", "close")

SYSTEM_PROMPTS = [
    "You are a friendly and helpful assistant.",
    "You are a helpful assistant. Answer briefly and politely.",
    "Keep your answers short and friendly.",
    "You are a cheerful assistant who gives practical advice.",
]


def _fill(template: str, slots: dict[str, str]) -> str:
    text = template.format(**slots)
    return text[:1].upper() + text[1:]


def dialogue(rng: random.Random) -> list[dict[str, str]]:
    """The messages of one dialogue."""
    topic = TOPICS[rng.choice(sorted(TOPICS))]
    slots = {k: rng.choice(v) for k, v in topic.items() if k not in STAGES}
    pairs = [rng.choice(topic["open"])]
    # Middle exchanges keep their listed order, which reads as a plausible conversation.
    middle = topic["middle"]
    pairs += [middle[i] for i in sorted(rng.sample(range(len(middle)), rng.randint(0, 3)))]
    pairs.append(rng.choice(topic["close"]))
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for pair in pairs:
        user, assistant = pair.split(" | ")
        messages.append({"role": "user", "content": _fill(user, slots)})
        messages.append({"role": "assistant", "content": _fill(assistant, slots)})
    if rng.random() < 0.05:
        _split_one(rng, messages)
    return messages


def _split_one(rng: random.Random, messages: list[dict[str, str]]) -> None:
    """Send one two-sentence turn as two messages of its role, as people do in chats."""
    candidates = [
        i
        for i, m in enumerate(messages)
        if m["role"] != "system" and ". " in m["content"].rstrip(".")
    ]
    if not candidates:
        return
    index = rng.choice(candidates)
    first, rest = messages[index]["content"].split(". ", 1)
    role = messages[index]["role"]
    messages[index : index + 1] = [
        {"role": role, "content": first + "."},
        {"role": role, "content": rest},
    ]


def main() -> None:
    rng = random.Random(SEED)
    lines = []
    for number in range(DIALOGUES):
        record: dict[str, object] = {"messages": dialogue(rng)}
        if rng.random() < 0.9:  # the rest get the reader's default id, line-<n>
            record = {"id": f"chat-{number:04d}", **record}
        lines.append(json.dumps(record, ensure_ascii=False))
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} dialogues to {OUT}")


if __name__ == "__main__":
    main()
