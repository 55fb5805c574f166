"""A spec-built environment: the data below, run by spec_env.SpecEnv (sandbox/image/spec_env.py)."""
from spec_env import SpecEnv

SPEC = {'entities': {'order': {'count': [3, 6],
                        'fields': {'order_id': {'type': 'id', 'pattern': 'O{n:04d}'},
                                   'status': {'type': 'choice', 'values': ['cancelled', 'other_status']},
                                   'reference_code': {'type': 'choice',
                                                      'values': ['reference_code_1',
                                                                 'reference_code_2',
                                                                 'reference_code_3']}}},
              'product': {'count': [3, 6], 'fields': {'product_id': {'type': 'id', 'pattern': 'P{n:04d}'}}},
              'user': {'count': [3, 6],
                       'fields': {'user_id': {'type': 'id', 'pattern': 'U{n:04d}'},
                                  'first_name': {'type': 'id', 'pattern': 'first_name_{n:03d}'},
                                  'email': {'type': 'id', 'pattern': 'email_{n:03d}'}}}},
 'task': {'order': {'type': 'pick', 'entity': 'order'},
          'reference': {'type': 'choice', 'values': ['RC{n:05d}']}},
 'tools': {'cancel_pending_order': {'kind': 'update',
                                    'entity': 'order',
                                    'arg': 'order_id',
                                    'set': {'status': 'cancelled'}}},
 'system_prompt': 'Help the user with the tools; check records before you answer.',
 'user_message': 'What is the reference code of {task.order.order_id}?',
 'reference': [{'call': 'cancel_pending_order', 'args': {'order_id': '{task.order.order_id}'}},
               {'reply': 'It is {task.order.reference_code}.'}],
 'reward': [{'name': 'looked_up',
             'weight': 0.5,
             'pred': {'op': 'called',
                      'tool': 'cancel_pending_order',
                      'args': {'order_id': '{task.order.order_id}'}}},
            {'name': 'told',
             'weight': 0.5,
             'pred': {'op': 'reply_contains', 'text': '{task.order.reference_code}'}}]}

TOOLS = [{'type': 'function',
  'function': {'name': 'cancel_pending_order',
               'description': 'Cancel a pending order. If the order is already processed or delivered,\n'
                              '\n'
                              'it cannot be cancelled. The agent needs to explain the cancellation detail\n'
                              'and ask for explicit user confirmation (yes/no) to proceed. If the user '
                              'confirms,\n'
                              "the order status will be changed to 'cancelled' and the payment will be "
                              'refunded.\n'
                              "The refund will be added to the user's gift card balance immediately if the "
                              'payment\n'
                              'was made using a gift card, otherwise the refund would take 5-7 business days '
                              'to process.\n'
                              'The function returns the order details after the cancellation.',
               'parameters': {'properties': {'order_id': {'description': "The order id, such as '#W0000000'. "
                                                                         "Be careful there is a '#' symbol "
                                                                         'at the beginning of the order id.',
                                                          'title': 'Order Id',
                                                          'type': 'string'},
                                             'reason': {'description': 'The reason for cancellation, which '
                                                                       "should be either 'no longer needed' "
                                                                       "or 'ordered by mistake'.",
                                                        'title': 'Reason',
                                                        'type': 'string'}},
                              'required': ['order_id', 'reason'],
                              'title': 'parameters',
                              'type': 'object'}}}]

POLICY = '# Retail agent policy\n\nAs a retail agent, you can help users:\n\n- **cancel or modify pending orders**\n- **return or exchange delivered orders**\n- **modify their default user address**\n- **provide information about their own profile, orders, and related products**\n\nAt the beginning of the conversation, you have to authenticate the user identity by locating their user id via email, or via name + zip code. This has to be done even when the user already provides the user id.\n\nOnce the user has been authenticated, you can provide the user with information about order, product, profile information, e.g. help the user look up order id.\n\nYou can only help one user per conversation (but you can handle multiple requests from the same user), and must deny any requests for tasks related to any other user.\n\nBefore taking any action that updates the database (cancel, modify, return, exchange), you must list the action details and obtain explicit user confirmation (yes) to proceed.\n\nYou should not make up any information or knowledge or procedures not provided by the user or the tools, or give subjective recommendations or comments.\n\nYou should at most make one tool call at a time, and if you take a tool call, you should not respond to the user at the same time. If you respond to the user, you should not make a tool call at the same time.\n\nYou should deny user requests that are against this policy.\n\nYou should transfer the user to a human agent if and only if the request cannot be handled within the scope of your actions. To transfer, first make a tool call to transfer_to_human_agents, and then send the message \'YOU ARE BEING TRANSFERRED TO A HUMAN AGENT. PLEASE HOLD ON.\' to the user.\n\n## Domain basic\n\n- All times in the database are EST and 24 hour based. For example "02:30:00" means 2:30 AM EST.\n\n### User\n\nEach user has a profile containing:\n\n- unique user id\n- email\n- default address\n- payment methods.\n\nThere are three types of payment methods: **gift card**, **paypal account**, **credit card**.\n\n### Product\n\nOur retail store has 50 types of products.\n\nFor each **type of product**, there are **variant items** of different **options**.\n\nFor example, for a \'t-shirt\' product, there could be a variant item with option \'color blue size M\', and another variant item with option \'color red size L\'.\n\nEach product has the following attributes:\n\n- unique product id\n- name\n- list of variants\n\nEach variant item has the following attributes:\n\n- unique item id\n- information about the value of the product options for this item.\n- availability\n- price\n\nNote: Product ID and Item ID have no relations and should not be confused!\n\n### Order\n\nEach order has the following attributes:\n\n- unique order id\n- user id\n- address\n- items ordered\n- status\n- fullfilments info (tracking id and item ids)\n- payment history\n\nThe status of an order can be: **pending**, **processed**, **delivered**, or **cancelled**.\n\nOrders can have other optional attributes based on the actions that have been taken (cancellation reason, which items have been exchanged, what was the exchane price difference etc)\n\n## Generic action rules\n\nGenerally, you can only take action on pending or delivered orders.\n\nExchange or modify order tools can only be called once per order. Be sure that all items to be changed are collected into a list before making the tool call!!!\n\n## Cancel pending order\n\nAn order can only be cancelled if its status is \'pending\', and you should check its status before taking the action.\n\nThe user needs to confirm the order id and the reason (either \'no longer needed\' or \'ordered by mistake\') for cancellation. Other reasons are not acceptable.\n\nAfter user confirmation, the order status will be changed to \'cancelled\', and the total will be refunded via the original payment method immediately if it is gift card, otherwise in 5 to 7 business days.\n\n## Modify pending order\n\nAn order can only be modified if its status is \'pending\', and you should check its status before taking the action.\n\nFor a pending order, you can take actions to modify its shipping address, payment method, or product item options, but nothing else.\n\n### Modify payment\n\nThe user can only choose a single payment method different from the original payment method.\n\nIf the user wants the modify the payment method to gift card, it must have enough balance to cover the total amount.\n\nAfter user confirmation, the order status will be kept as \'pending\'. The original payment method will be refunded immediately if it is a gift card, otherwise it will be refunded within 5 to 7 business days.\n\n### Modify items\n\nThis action can only be called once, and will change the order status to \'pending (items modifed)\'. The agent will not be able to modify or cancel the order anymore. So you must confirm all the details are correct and be cautious before taking this action. In particular, remember to remind the customer to confirm they have provided all the items they want to modify.\n\nFor a pending order, each item can be modified to an available new item of the same product but of different product option. There cannot be any change of product types, e.g. modify shirt to shoe.\n\nThe user must provide a payment method to pay or receive refund of the price difference. If the user provides a gift card, it must have enough balance to cover the price difference.\n\n## Return delivered order\n\nAn order can only be returned if its status is \'delivered\', and you should check its status before taking the action.\n\nThe user needs to confirm the order id and the list of items to be returned.\n\nThe user needs to provide a payment method to receive the refund.\n\nThe refund must either go to the original payment method, or an existing gift card.\n\nAfter user confirmation, the order status will be changed to \'return requested\', and the user will receive an email regarding how to return items.\n\n## Exchange delivered order\n\nAn order can only be exchanged if its status is \'delivered\', and you should check its status before taking the action. In particular, remember to remind the customer to confirm they have provided all items to be exchanged.\n\nFor a delivered order, each item can be exchanged to an available new item of the same product but of different product option. There cannot be any change of product types, e.g. modify shirt to shoe.\n\nThe user must provide a payment method to pay or receive refund of the price difference. If the user provides a gift card, it must have enough balance to cover the price difference.\n\nAfter user confirmation, the order status will be changed to \'exchange requested\', and the user will receive an email regarding how to return items. There is no need to place a new order.\n'


class Env(SpecEnv):
    SPEC = SPEC
    TOOLS = TOOLS
    POLICY = POLICY
