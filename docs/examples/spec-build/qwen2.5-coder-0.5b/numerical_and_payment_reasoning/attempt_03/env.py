"""A spec-built environment: the data below, run by spec_env.SpecEnv (sandbox/image/spec_env.py)."""
from spec_env import SpecEnv

SPEC = {'entities': {'user': {'count': [3, 6], 'fields': {'user_id': {'type': 'id', 'pattern': 'U{n:04d}'}}},
              'reservation': {'count': [3, 6],
                              'fields': {'reservation_id': {'type': 'choice',
                                                            'values': ['reference_code_1',
                                                                       'reference_code_2',
                                                                       'reference_code_3']}}}},
 'task': {'reservation': {'type': 'pick', 'entity': 'reservation'}},
 'tools': {'book_reservation': {'kind': 'read', 'entity': 'user', 'arg': 'user_id', 'field': 'user_id'}},
 'system_prompt': 'Help the user with the tools; check records before you answer.',
 'user_message': 'What is the reference code of {task.reservation.reservation_id}?',
 'hint': 'The reference code should be one of the following: {reference_code_1}, {reference_code_2}, or '
         '{reference_code_3}.',
 'reference': [{'call': 'book_reservation',
                'args': {'user_id': '{task.reservation.reservation_id}'},
                'when': {'op': 'called', 'tool': 'book_reservation', 'args': {}}}],
 'reward': [{'name': 'looked_up',
             'weight': 0.5,
             'pred': {'op': 'called', 'tool': 'book_reservation', 'args': {}}}]}

TOOLS = [{'type': 'function',
  'function': {'name': 'book_reservation',
               'description': 'Book a reservation.',
               'parameters': {'$defs': {'FlightInfo': {'properties': {'flight_number': {'description': 'Flight '
                                                                                                       'number, '
                                                                                                       'such '
                                                                                                       'as '
                                                                                                       "'HAT001'.",
                                                                                        'title': 'Flight '
                                                                                                 'Number',
                                                                                        'type': 'string'},
                                                                      'date': {'description': 'The date for '
                                                                                              'the flight in '
                                                                                              'the format '
                                                                                              "'YYYY-MM-DD', "
                                                                                              'such as '
                                                                                              "'2024-05-01'.",
                                                                               'title': 'Date',
                                                                               'type': 'string'}},
                                                       'required': ['flight_number', 'date'],
                                                       'title': 'FlightInfo',
                                                       'type': 'object'},
                                        'Passenger': {'properties': {'first_name': {'description': "Passenger's "
                                                                                                   'first '
                                                                                                   'name',
                                                                                    'title': 'First Name',
                                                                                    'type': 'string'},
                                                                     'last_name': {'description': "Passenger's "
                                                                                                  'last name',
                                                                                   'title': 'Last Name',
                                                                                   'type': 'string'},
                                                                     'dob': {'description': 'Date of birth '
                                                                                            'in YYYY-MM-DD '
                                                                                            'format',
                                                                             'title': 'Dob',
                                                                             'type': 'string'}},
                                                      'required': ['first_name', 'last_name', 'dob'],
                                                      'title': 'Passenger',
                                                      'type': 'object'},
                                        'Payment': {'properties': {'payment_id': {'description': 'Unique '
                                                                                                 'identifier '
                                                                                                 'for the '
                                                                                                 'payment',
                                                                                  'title': 'Payment Id',
                                                                                  'type': 'string'},
                                                                   'amount': {'description': 'Payment amount '
                                                                                             'in dollars',
                                                                              'title': 'Amount',
                                                                              'type': 'integer'}},
                                                    'required': ['payment_id', 'amount'],
                                                    'title': 'Payment',
                                                    'type': 'object'}},
                              'properties': {'user_id': {'description': 'The ID of the user to book the '
                                                                        'reservation such as '
                                                                        "'sara_doe_496'`.",
                                                         'title': 'User Id',
                                                         'type': 'string'},
                                             'origin': {'description': 'The IATA code for the origin city '
                                                                       "such as 'SFO'.",
                                                        'title': 'Origin',
                                                        'type': 'string'},
                                             'destination': {'description': 'The IATA code for the '
                                                                            "destination city such as 'JFK'.",
                                                             'title': 'Destination',
                                                             'type': 'string'},
                                             'flight_type': {'description': 'The type of flight such as '
                                                                            "'one_way' or 'round_trip'.",
                                                             'enum': ['round_trip', 'one_way'],
                                                             'title': 'Flight Type',
                                                             'type': 'string'},
                                             'cabin': {'description': 'The cabin class such as '
                                                                      "'basic_economy', 'economy', or "
                                                                      "'business'.",
                                                       'enum': ['business', 'economy', 'basic_economy'],
                                                       'title': 'Cabin',
                                                       'type': 'string'},
                                             'flights': {'description': 'An array of objects containing '
                                                                        'details about each piece of flight.',
                                                         'items': {'anyOf': [{'$ref': '#/$defs/FlightInfo'},
                                                                             {'additionalProperties': True,
                                                                              'type': 'object'}]},
                                                         'title': 'Flights',
                                                         'type': 'array'},
                                             'passengers': {'description': 'An array of objects containing '
                                                                           'details about each passenger.',
                                                            'items': {'anyOf': [{'$ref': '#/$defs/Passenger'},
                                                                                {'additionalProperties': True,
                                                                                 'type': 'object'}]},
                                                            'title': 'Passengers',
                                                            'type': 'array'},
                                             'payment_methods': {'description': 'An array of objects '
                                                                                'containing details about '
                                                                                'each payment method.',
                                                                 'items': {'anyOf': [{'$ref': '#/$defs/Payment'},
                                                                                     {'additionalProperties': True,
                                                                                      'type': 'object'}]},
                                                                 'title': 'Payment Methods',
                                                                 'type': 'array'},
                                             'total_baggages': {'description': 'The total number of baggage '
                                                                               'items to book the '
                                                                               'reservation.',
                                                                'title': 'Total Baggages',
                                                                'type': 'integer'},
                                             'nonfree_baggages': {'description': 'The number of non-free '
                                                                                 'baggage items to book the '
                                                                                 'reservation.',
                                                                  'title': 'Nonfree Baggages',
                                                                  'type': 'integer'},
                                             'insurance': {'description': 'Whether the reservation has '
                                                                          'insurance.',
                                                           'enum': ['yes', 'no'],
                                                           'title': 'Insurance',
                                                           'type': 'string'}},
                              'required': ['user_id',
                                           'origin',
                                           'destination',
                                           'flight_type',
                                           'cabin',
                                           'flights',
                                           'passengers',
                                           'payment_methods',
                                           'total_baggages',
                                           'nonfree_baggages',
                                           'insurance'],
                              'title': 'parameters',
                              'type': 'object'}}}]

POLICY = "# Airline Agent Policy\n\nThe current time is 2024-05-15 15:00:00 EST.\n\nAs an airline agent, you can help users **book**, **modify**, or **cancel** flight reservations. You also handle **refunds and compensation**.\n\nBefore taking any actions that update the booking database (booking, modifying flights, editing baggage, changing cabin class, or updating passenger information), you must list the action details and obtain explicit user confirmation (yes) to proceed.\n\nYou should not provide any information, knowledge, or procedures not provided by the user or available tools, or give subjective recommendations or comments.\n\nYou should only make one tool call at a time, and if you make a tool call, you should not respond to the user simultaneously. If you respond to the user, you should not make a tool call at the same time.\n\nYou should deny user requests that are against this policy.\n\nYou should transfer the user to a human agent if and only if the request cannot be handled within the scope of your actions. To transfer, first make a tool call to transfer_to_human_agents, and then send the message 'YOU ARE BEING TRANSFERRED TO A HUMAN AGENT. PLEASE HOLD ON.' to the user.\n\n## Domain Basic\n\n### User\nEach user has a profile containing:\n- user id\n- email\n- addresses\n- date of birth\n- payment methods\n- membership level\n- reservation numbers\n\nThere are three types of payment methods: **credit card**, **gift card**, **travel certificate**.\n\nThere are three membership levels: **regular**, **silver**, **gold**.\n\n### Flight\nEach flight has the following attributes:\n- flight number\n- origin\n- destination\n- scheduled departure and arrival time (local time)\n\nA flight can be available at multiple dates. For each date:\n- If the status is **available**, the flight has not taken off, available seats and prices are listed.\n- If the status is **delayed** or **on time**, the flight has not taken off, cannot be booked.\n- If the status is **flying**, the flight has taken off but not landed, cannot be booked.\n\nThere are three cabin classes: **basic economy**, **economy**, **business**. **basic economy** is its own class, completely distinct from **economy**.\n\nSeat availability and prices are listed for each cabin class.\n\n### Reservation\nEach reservation specifies the following:\n- reservation id\n- user id\n- trip type\n- flights\n- passengers\n- payment methods\n- created time\n- baggages\n- travel insurance information\n\nThere are two types of trip: **one way** and **round trip**.\n\n## Book flight\n\nThe agent must first obtain the user id from the user. \n\nThe agent should then ask for the trip type, origin, destination.\n\nCabin:\n- Cabin class must be the same across all the flights in a reservation. \n\nPassengers: \n- Each reservation can have at most five passengers. \n- The agent needs to collect the first name, last name, and date of birth for each passenger. \n- All passengers must fly the same flights in the same cabin.\n\nPayment: \n- Each reservation can use at most one travel certificate, at most one credit card, and at most three gift cards. \n- The remaining amount of a travel certificate is not refundable. \n- All payment methods must already be in user profile for safety reasons.\n\nChecked bag allowance: \n- If the booking user is a regular member:\n  - 0 free checked bag for each basic economy passenger\n  - 1 free checked bag for each economy passenger\n  - 2 free checked bags for each business passenger\n- If the booking user is a silver member:\n  - 1 free checked bag for each basic economy passenger\n  - 2 free checked bag for each economy passenger\n  - 3 free checked bags for each business passenger\n- If the booking user is a gold member:\n  - 2 free checked bag for each basic economy passenger\n  - 3 free checked bag for each economy passenger\n  - 4 free checked bags for each business passenger\n- Each extra baggage is 50 dollars.\n\nDo not add checked bags that the user does not need.\n\nTravel insurance: \n- The agent should ask if the user wants to buy the travel insurance.\n- The travel insurance is 30 dollars per passenger and enables full refund if the user needs to cancel the flight given health or weather reasons.\n\n## Modify flight\n\nFirst, the agent must obtain the user id and reservation id. \n- The user must provide their user id. \n- If the user doesn't know their reservation id, the agent should help locate it using available tools.\n\nChange flights: \n- Basic economy flights cannot be modified.\n- Other reservations can be modified without changing the origin, destination, and trip type.\n- Some flight segments can be kept, but their prices will not be updated based on the current price.\n- The API does not check these for the agent, so the agent must make sure the rules apply before calling the API!\n\nChange cabin: \n- Cabin cannot be changed if any flight in the reservation has already been flown.\n- In other cases, all reservations, including basic economy, can change cabin without changing the flights.\n- Cabin class must remain the same across all the flights in the same reservation; changing cabin for just one flight segment is not possible.\n- If the price after cabin change is higher than the original price, the user is required to pay for the difference.\n- If the price after cabin change is lower than the original price, the user is should be refunded the difference.\n\nChange baggage and insurance: \n- The user can add but not remove checked bags.\n- The user cannot add insurance after initial booking.\n\nChange passengers:\n- The user can modify passengers but cannot modify the number of passengers.\n- Even a human agent cannot modify the number of passengers.\n\nPayment: \n- If the flights are changed, the user needs to provide a single gift card or credit card for payment or refund method. The payment method must already be in user profile for safety reasons.\n\n## Cancel flight\n\nFirst, the agent must obtain the user id and reservation id. \n- The user must provide their user id. \n- If the user doesn't know their reservation id, the agent should help locate it using available tools.\n\nThe agent must also obtain the reason for cancellation (change of plan, airline cancelled flight, or other reasons)\n\nIf any portion of the flight has already been flown, the agent cannot help and transfer is needed.\n\nOtherwise, flight can be cancelled if any of the following is true:\n- The booking was made within the last 24 hrs\n- The flight is cancelled by airline\n- It is a business flight\n- The user has travel insurance and the reason for cancellation is covered by insurance.\n\nThe API does not check that cancellation rules are met, so the agent must make sure the rules apply before calling the API!\n\nRefund:\n- The refund will go to original payment methods within 5 to 7 business days.\n\n## Refunds and Compensation\nDo not proactively offer a compensation unless the user explicitly asks for one.\n\nDo not compensate if the user is regular member and has no travel insurance and flies (basic) economy.\n\nAlways confirms the facts before offering compensation.\n\nOnly compensate if the user is a silver/gold member or has travel insurance or flies business.\n\n- If the user complains about cancelled flights in a reservation, the agent can offer a certificate as a gesture after confirming the facts, with the amount being $100 times the number of passengers.\n\n- If the user complains about delayed flights in a reservation and wants to change or cancel the reservation, the agent can offer a certificate as a gesture after confirming the facts and changing or cancelling the reservation, with the amount being $50 times the number of passengers.\n\nDo not offer compensation for any other reason than the ones listed above."


class Env(SpecEnv):
    SPEC = SPEC
    TOOLS = TOOLS
    POLICY = POLICY
