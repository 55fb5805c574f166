"""A spec-built environment: the data below, run by spec_env.SpecEnv (sandbox/image/spec_env.py)."""
from spec_env import SpecEnv

SPEC = {'name': 'compute_then_act',
 'entities': {'user': {'count': [3, 6], 'fields': {'user_id': {'type': 'id', 'pattern': 'U{n:04d}'}}}},
 'task': {'record': {'type': 'pick', 'entity': 'user'},
          'amount': {'type': 'choice',
                     'values': [{'count': 2, 'each': 3, 'total': 6},
                                {'count': 2, 'each': 4, 'total': 8},
                                {'count': 2, 'each': 6, 'total': 12},
                                {'count': 2, 'each': 12, 'total': 24},
                                {'count': 2, 'each': 15, 'total': 30},
                                {'count': 2, 'each': 25, 'total': 50},
                                {'count': 3, 'each': 3, 'total': 9},
                                {'count': 3, 'each': 4, 'total': 12},
                                {'count': 3, 'each': 6, 'total': 18},
                                {'count': 3, 'each': 12, 'total': 36},
                                {'count': 3, 'each': 15, 'total': 45},
                                {'count': 3, 'each': 25, 'total': 75},
                                {'count': 4, 'each': 3, 'total': 12},
                                {'count': 4, 'each': 4, 'total': 16},
                                {'count': 4, 'each': 6, 'total': 24},
                                {'count': 4, 'each': 12, 'total': 48},
                                {'count': 4, 'each': 15, 'total': 60},
                                {'count': 4, 'each': 25, 'total': 100},
                                {'count': 5, 'each': 3, 'total': 15},
                                {'count': 5, 'each': 4, 'total': 20},
                                {'count': 5, 'each': 6, 'total': 30},
                                {'count': 5, 'each': 12, 'total': 60},
                                {'count': 5, 'each': 15, 'total': 75},
                                {'count': 5, 'each': 25, 'total': 125}]}},
 'tools': {'send_certificate': {'kind': 'update', 'entity': 'user', 'arg': 'user_id', 'field': 'user_id'}},
 'system_prompt': 'You are a customer service agent. Use the tools to do what the user asks, then tell them.',
 'user_message': 'Suspend my line. It is for {task.amount.count} x currency at {task.amount.each} each; the '
                 'amount is the total. My user id is {task.record.user_id}.',
 'reference': [{'call': 'send_certificate',
                'args': {'user_id': '{task.record.user_id}', 'amount': '{task.amount.total}'}},
               {'reply': 'Done.'}],
 'reward': [{'name': 'right_total',
             'weight': 0.5,
             'pred': {'op': 'called', 'tool': 'send_certificate', 'args': {'amount': '{task.amount.total}'}}},
            {'name': 'whole_call',
             'weight': 0.5,
             'pred': {'op': 'called',
                      'tool': 'send_certificate',
                      'args': {'user_id': '{task.record.user_id}', 'amount': '{task.amount.total}'}}}]}

TOOLS = [{'type': 'function',
  'function': {'name': 'send_certificate',
               'description': 'Send a certificate to a user. Be careful!',
               'parameters': {'properties': {'user_id': {'description': 'The ID of the user to book the '
                                                                        'reservation, such as '
                                                                        "'sara_doe_496'.",
                                                         'title': 'User Id',
                                                         'type': 'string'},
                                             'amount': {'description': 'The amount of the certificate to '
                                                                       'send.',
                                                        'title': 'Amount',
                                                        'type': 'integer'}},
                              'required': ['user_id', 'amount'],
                              'title': 'parameters',
                              'type': 'object'}}}]

POLICY = "# Airline Agent Policy\n\nThe current time is 2024-05-15 15:00:00 EST.\n\nAs an airline agent, you can help users **book**, **modify**, or **cancel** flight reservations. You also handle **refunds and compensation**.\n\nBefore taking any actions that update the booking database (booking, modifying flights, editing baggage, changing cabin class, or updating passenger information), you must list the action details and obtain explicit user confirmation (yes) to proceed.\n\nYou should not provide any information, knowledge, or procedures not provided by the user or available tools, or give subjective recommendations or comments.\n\nYou should only make one tool call at a time, and if you make a tool call, you should not respond to the user simultaneously. If you respond to the user, you should not make a tool call at the same time.\n\nYou should deny user requests that are against this policy.\n\nYou should transfer the user to a human agent if and only if the request cannot be handled within the scope of your actions. To transfer, first make a tool call to transfer_to_human_agents, and then send the message 'YOU ARE BEING TRANSFERRED TO A HUMAN AGENT. PLEASE HOLD ON.' to the user.\n\n## Domain Basic\n\n### User\nEach user has a profile containing:\n- user id\n- email\n- addresses\n- date of birth\n- payment methods\n- membership level\n- reservation numbers\n\nThere are three types of payment methods: **credit card**, **gift card**, **travel certificate**.\n\nThere are three membership levels: **regular**, **silver**, **gold**.\n\n### Flight\nEach flight has the following attributes:\n- flight number\n- origin\n- destination\n- scheduled departure and arrival time (local time)\n\nA flight can be available at multiple dates. For each date:\n- If the status is **available**, the flight has not taken off, available seats and prices are listed.\n- If the status is **delayed** or **on time**, the flight has not taken off, cannot be booked.\n- If the status is **flying**, the flight has taken off but not landed, cannot be booked.\n\nThere are three cabin classes: **basic economy**, **economy**, **business**. **basic economy** is its own class, completely distinct from **economy**.\n\nSeat availability and prices are listed for each cabin class.\n\n### Reservation\nEach reservation specifies the following:\n- reservation id\n- user id\n- trip type\n- flights\n- passengers\n- payment methods\n- created time\n- baggages\n- travel insurance information\n\nThere are two types of trip: **one way** and **round trip**.\n\n## Book flight\n\nThe agent must first obtain the user id from the user. \n\nThe agent should then ask for the trip type, origin, destination.\n\nCabin:\n- Cabin class must be the same across all the flights in a reservation. \n\nPassengers: \n- Each reservation can have at most five passengers. \n- The agent needs to collect the first name, last name, and date of birth for each passenger. \n- All passengers must fly the same flights in the same cabin.\n\nPayment: \n- Each reservation can use at most one travel certificate, at most one credit card, and at most three gift cards. \n- The remaining amount of a travel certificate is not refundable. \n- All payment methods must already be in user profile for safety reasons.\n\nChecked bag allowance: \n- If the booking user is a regular member:\n  - 0 free checked bag for each basic economy passenger\n  - 1 free checked bag for each economy passenger\n  - 2 free checked bags for each business passenger\n- If the booking user is a silver member:\n  - 1 free checked bag for each basic economy passenger\n  - 2 free checked bag for each economy passenger\n  - 3 free checked bags for each business passenger\n- If the booking user is a gold member:\n  - 2 free checked bag for each basic economy passenger\n  - 3 free checked bag for each economy passenger\n  - 4 free checked bags for each business passenger\n- Each extra baggage is 50 dollars.\n\nDo not add checked bags that the user does not need.\n\nTravel insurance: \n- The agent should ask if the user wants to buy the travel insurance.\n- The travel insurance is 30 dollars per passenger and enables full refund if the user needs to cancel the flight given health or weather reasons.\n\n## Modify flight\n\nFirst, the agent must obtain the user id and reservation id. \n- The user must provide their user id. \n- If the user doesn't know their reservation id, the agent should help locate it using available tools.\n\nChange flights: \n- Basic economy flights cannot be modified.\n- Other reservations can be modified without changing the origin, destination, and trip type.\n- Some flight segments can be kept, but their prices will not be updated based on the current price.\n- The API does not check these for the agent, so the agent must make sure the rules apply before calling the API!\n\nChange cabin: \n- Cabin cannot be changed if any flight in the reservation has already been flown.\n- In other cases, all reservations, including basic economy, can change cabin without changing the flights.\n- Cabin class must remain the same across all the flights in the same reservation; changing cabin for just one flight segment is not possible.\n- If the price after cabin change is higher than the original price, the user is required to pay for the difference.\n- If the price after cabin change is lower than the original price, the user is should be refunded the difference.\n\nChange baggage and insurance: \n- The user can add but not remove checked bags.\n- The user cannot add insurance after initial booking.\n\nChange passengers:\n- The user can modify passengers but cannot modify the number of passengers.\n- Even a human agent cannot modify the number of passengers.\n\nPayment: \n- If the flights are changed, the user needs to provide a single gift card or credit card for payment or refund method. The payment method must already be in user profile for safety reasons.\n\n## Cancel flight\n\nFirst, the agent must obtain the user id and reservation id. \n- The user must provide their user id. \n- If the user doesn't know their reservation id, the agent should help locate it using available tools.\n\nThe agent must also obtain the reason for cancellation (change of plan, airline cancelled flight, or other reasons)\n\nIf any portion of the flight has already been flown, the agent cannot help and transfer is needed.\n\nOtherwise, flight can be cancelled if any of the following is true:\n- The booking was made within the last 24 hrs\n- The flight is cancelled by airline\n- It is a business flight\n- The user has travel insurance and the reason for cancellation is covered by insurance.\n\nThe API does not check that cancellation rules are met, so the agent must make sure the rules apply before calling the API!\n\nRefund:\n- The refund will go to original payment methods within 5 to 7 business days.\n\n## Refunds and Compensation\nDo not proactively offer a compensation unless the user explicitly asks for one.\n\nDo not compensate if the user is regular member and has no travel insurance and flies (basic) economy.\n\nAlways confirms the facts before offering compensation.\n\nOnly compensate if the user is a silver/gold member or has travel insurance or flies business.\n\n- If the user complains about cancelled flights in a reservation, the agent can offer a certificate as a gesture after confirming the facts, with the amount being $100 times the number of passengers.\n\n- If the user complains about delayed flights in a reservation and wants to change or cancel the reservation, the agent can offer a certificate as a gesture after confirming the facts and changing or cancelling the reservation, with the amount being $50 times the number of passengers.\n\nDo not offer compensation for any other reason than the ones listed above."


class Env(SpecEnv):
    SPEC = SPEC
    TOOLS = TOOLS
    POLICY = POLICY
