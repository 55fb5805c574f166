"""A spec-built environment: the data below, run by spec_env.SpecEnv (sandbox/image/spec_env.py)."""
from spec_env import SpecEnv

SPEC = {'name': 'multi_write',
 'entities': {'order': {'count': [3, 6], 'fields': {'order_id': {'type': 'id', 'pattern': 'O{n:04d}'}}}},
 'task': {'record': {'type': 'pick', 'entity': 'order'},
          'stated_item_ids': {'type': 'choice',
                              'values': [['item_ids_1042'],
                                         ['item_ids_2387'],
                                         ['item_ids_1042', 'item_ids_3719'],
                                         ['item_ids_2387', 'item_ids_4560']]},
          'stated_new_item_ids': {'type': 'choice',
                                  'values': [['new_item_ids_1042'],
                                             ['new_item_ids_2387'],
                                             ['new_item_ids_1042', 'new_item_ids_3719'],
                                             ['new_item_ids_2387', 'new_item_ids_4560']]},
          'stated_payment_method_id': {'type': 'choice',
                                       'values': ['PM1042', 'PM2387', 'PM3719', 'PM4560', 'PM5823']}},
 'tools': {'exchange_delivered_order_items': {'kind': 'update',
                                              'entity': 'order',
                                              'arg': 'order_id',
                                              'field': 'order_id'},
           'modify_pending_order_payment': {'kind': 'update',
                                            'entity': 'order',
                                            'arg': 'order_id',
                                            'field': 'order_id'}},
 'system_prompt': 'You are a customer service agent. Use the tools to do what the user asks, then tell them. '
                  'Finish every part of a request before you reply.',
 'user_message': 'Suspend my line. It needs all of: exchange delivered order items, modify pending order '
                 'payment. My order id is {task.record.order_id}. My item ids is {task.stated_item_ids}. My '
                 'new item ids is {task.stated_new_item_ids}. My payment method id is '
                 '{task.stated_payment_method_id}.',
 'reference': [{'call': 'exchange_delivered_order_items',
                'args': {'order_id': '{task.record.order_id}',
                         'item_ids': '{task.stated_item_ids}',
                         'new_item_ids': '{task.stated_new_item_ids}',
                         'payment_method_id': '{task.stated_payment_method_id}'}},
               {'call': 'modify_pending_order_payment',
                'args': {'order_id': '{task.record.order_id}',
                         'payment_method_id': '{task.stated_payment_method_id}'}},
               {'reply': 'Done.'}],
 'reward': [{'name': 'called_exchange_delivered_order_items',
             'weight': 0.5,
             'pred': {'op': 'called',
                      'tool': 'exchange_delivered_order_items',
                      'args': {'order_id': '{task.record.order_id}',
                               'item_ids': '{task.stated_item_ids}',
                               'new_item_ids': '{task.stated_new_item_ids}',
                               'payment_method_id': '{task.stated_payment_method_id}'}}},
            {'name': 'called_modify_pending_order_payment',
             'weight': 0.5,
             'pred': {'op': 'called',
                      'tool': 'modify_pending_order_payment',
                      'args': {'order_id': '{task.record.order_id}',
                               'payment_method_id': '{task.stated_payment_method_id}'}}}]}

TOOLS = [{'type': 'function',
  'function': {'name': 'exchange_delivered_order_items',
               'description': 'Exchange items in a delivered order to new items of the same product type.\n'
                              '\n'
                              'For a delivered order, return or exchange can be only done once by the '
                              'agent.\n'
                              'The agent needs to explain the exchange detail and ask for explicit user '
                              'confirmation (yes/no) to proceed.',
               'parameters': {'properties': {'order_id': {'description': "The order id, such as '#W0000000'. "
                                                                         "Be careful there is a '#' symbol "
                                                                         'at the beginning of the order id.',
                                                          'title': 'Order Id',
                                                          'type': 'string'},
                                             'item_ids': {'description': 'The item ids to be exchanged, each '
                                                                         "such as '1008292230'. There could "
                                                                         'be duplicate items in the list.',
                                                          'items': {'type': 'string'},
                                                          'title': 'Item Ids',
                                                          'type': 'array'},
                                             'new_item_ids': {'description': 'The item ids to be exchanged '
                                                                             'for, each such as '
                                                                             "'1008292230'.\n"
                                                                             'There could be duplicate items '
                                                                             'in the list. Each new item id '
                                                                             'should match the item id\n'
                                                                             'in the same position and be of '
                                                                             'the same product.',
                                                              'items': {'type': 'string'},
                                                              'title': 'New Item Ids',
                                                              'type': 'array'},
                                             'payment_method_id': {'description': 'The payment method id to '
                                                                                  'pay or receive refund for '
                                                                                  'the item price '
                                                                                  'difference,\n'
                                                                                  'such as '
                                                                                  "'gift_card_0000000' or "
                                                                                  "'credit_card_0000000'. "
                                                                                  'These can be looked up\n'
                                                                                  'from the user or order '
                                                                                  'details.',
                                                                   'title': 'Payment Method Id',
                                                                   'type': 'string'}},
                              'required': ['order_id', 'item_ids', 'new_item_ids', 'payment_method_id'],
                              'title': 'parameters',
                              'type': 'object'}}},
 {'type': 'function',
  'function': {'name': 'modify_pending_order_payment',
               'description': 'Modify the payment method of a pending order. The agent needs to explain the '
                              'modification detail and ask for explicit user confirmation (yes/no) to '
                              'proceed.',
               'parameters': {'properties': {'order_id': {'description': "The order id, such as '#W0000000'. "
                                                                         "Be careful there is a '#' symbol "
                                                                         'at the beginning of the order id.',
                                                          'title': 'Order Id',
                                                          'type': 'string'},
                                             'payment_method_id': {'description': 'The payment method id to '
                                                                                  'pay or receive refund for '
                                                                                  'the item price '
                                                                                  'difference, such as '
                                                                                  "'gift_card_0000000' or "
                                                                                  "'credit_card_0000000'. "
                                                                                  'These can be looked up '
                                                                                  'from the user or order '
                                                                                  'details.',
                                                                   'title': 'Payment Method Id',
                                                                   'type': 'string'}},
                              'required': ['order_id', 'payment_method_id'],
                              'title': 'parameters',
                              'type': 'object'}}}]

POLICY = '# Retail agent policy\n\nAs a retail agent, you can help users:\n\n- **cancel or modify pending orders**\n- **return or exchange delivered orders**\n- **modify their default user address**\n- **provide information about their own profile, orders, and related products**\n\nAt the beginning of the conversation, you have to authenticate the user identity by locating their user id via email, or via name + zip code. This has to be done even when the user already provides the user id.\n\nOnce the user has been authenticated, you can provide the user with information about order, product, profile information, e.g. help the user look up order id.\n\nYou can only help one user per conversation (but you can handle multiple requests from the same user), and must deny any requests for tasks related to any other user.\n\nBefore taking any action that updates the database (cancel, modify, return, exchange), you must list the action details and obtain explicit user confirmation (yes) to proceed.\n\nYou should not make up any information or knowledge or procedures not provided by the user or the tools, or give subjective recommendations or comments.\n\nYou should at most make one tool call at a time, and if you take a tool call, you should not respond to the user at the same time. If you respond to the user, you should not make a tool call at the same time.\n\nYou should deny user requests that are against this policy.\n\nYou should transfer the user to a human agent if and only if the request cannot be handled within the scope of your actions. To transfer, first make a tool call to transfer_to_human_agents, and then send the message \'YOU ARE BEING TRANSFERRED TO A HUMAN AGENT. PLEASE HOLD ON.\' to the user.\n\n## Domain basic\n\n- All times in the database are EST and 24 hour based. For example "02:30:00" means 2:30 AM EST.\n\n### User\n\nEach user has a profile containing:\n\n- unique user id\n- email\n- default address\n- payment methods.\n\nThere are three types of payment methods: **gift card**, **paypal account**, **credit card**.\n\n### Product\n\nOur retail store has 50 types of products.\n\nFor each **type of product**, there are **variant items** of different **options**.\n\nFor example, for a \'t-shirt\' product, there could be a variant item with option \'color blue size M\', and another variant item with option \'color red size L\'.\n\nEach product has the following attributes:\n\n- unique product id\n- name\n- list of variants\n\nEach variant item has the following attributes:\n\n- unique item id\n- information about the value of the product options for this item.\n- availability\n- price\n\nNote: Product ID and Item ID have no relations and should not be confused!\n\n### Order\n\nEach order has the following attributes:\n\n- unique order id\n- user id\n- address\n- items ordered\n- status\n- fullfilments info (tracking id and item ids)\n- payment history\n\nThe status of an order can be: **pending**, **processed**, **delivered**, or **cancelled**.\n\nOrders can have other optional attributes based on the actions that have been taken (cancellation reason, which items have been exchanged, what was the exchane price difference etc)\n\n## Generic action rules\n\nGenerally, you can only take action on pending or delivered orders.\n\nExchange or modify order tools can only be called once per order. Be sure that all items to be changed are collected into a list before making the tool call!!!\n\n## Cancel pending order\n\nAn order can only be cancelled if its status is \'pending\', and you should check its status before taking the action.\n\nThe user needs to confirm the order id and the reason (either \'no longer needed\' or \'ordered by mistake\') for cancellation. Other reasons are not acceptable.\n\nAfter user confirmation, the order status will be changed to \'cancelled\', and the total will be refunded via the original payment method immediately if it is gift card, otherwise in 5 to 7 business days.\n\n## Modify pending order\n\nAn order can only be modified if its status is \'pending\', and you should check its status before taking the action.\n\nFor a pending order, you can take actions to modify its shipping address, payment method, or product item options, but nothing else.\n\n### Modify payment\n\nThe user can only choose a single payment method different from the original payment method.\n\nIf the user wants the modify the payment method to gift card, it must have enough balance to cover the total amount.\n\nAfter user confirmation, the order status will be kept as \'pending\'. The original payment method will be refunded immediately if it is a gift card, otherwise it will be refunded within 5 to 7 business days.\n\n### Modify items\n\nThis action can only be called once, and will change the order status to \'pending (items modifed)\'. The agent will not be able to modify or cancel the order anymore. So you must confirm all the details are correct and be cautious before taking this action. In particular, remember to remind the customer to confirm they have provided all the items they want to modify.\n\nFor a pending order, each item can be modified to an available new item of the same product but of different product option. There cannot be any change of product types, e.g. modify shirt to shoe.\n\nThe user must provide a payment method to pay or receive refund of the price difference. If the user provides a gift card, it must have enough balance to cover the price difference.\n\n## Return delivered order\n\nAn order can only be returned if its status is \'delivered\', and you should check its status before taking the action.\n\nThe user needs to confirm the order id and the list of items to be returned.\n\nThe user needs to provide a payment method to receive the refund.\n\nThe refund must either go to the original payment method, or an existing gift card.\n\nAfter user confirmation, the order status will be changed to \'return requested\', and the user will receive an email regarding how to return items.\n\n## Exchange delivered order\n\nAn order can only be exchanged if its status is \'delivered\', and you should check its status before taking the action. In particular, remember to remind the customer to confirm they have provided all items to be exchanged.\n\nFor a delivered order, each item can be exchanged to an available new item of the same product but of different product option. There cannot be any change of product types, e.g. modify shirt to shoe.\n\nThe user must provide a payment method to pay or receive refund of the price difference. If the user provides a gift card, it must have enough balance to cover the price difference.\n\nAfter user confirmation, the order status will be changed to \'exchange requested\', and the user will receive an email regarding how to return items. There is no need to place a new order.\n'


class Env(SpecEnv):
    SPEC = SPEC
    TOOLS = TOOLS
    POLICY = POLICY
